"""TOP001 `unused-suppression`: a suppression comment whose torchopt codes silence nothing."""

from __future__ import annotations

from torchopt.codemods.suppression import FAMILY
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid
from torchopt.rewrite.suppress import UNUSED_CODE


class UnusedSuppression(Rule):
    """## What it does
    Reports a suppression comment (`# noqa: TOP101`, `# torchopt: ignore[TOP101]`) naming a torchopt
    code that silences nothing on its line, or a code no rule has (`# noqa: TOP999`), like ruff's
    `RUF100`. Codes of other tools (`# noqa: E501`) and a bare `# noqa` (other linters read it too)
    are left alone, and so are codes of rules this run does not enable: a run with a narrower
    `--select` never calls a suppression the full run needs unused.

    ## Why is this slow
    It is not: a stale suppression hides the next real finding on its line. A rule that stopped
    reporting there (the code was fixed, or torchopt learned better) leaves a comment that silences
    whatever comes next.

    ## Example
    ```python
    x = torch.zeros(3, device="cuda")  # noqa: TOP101
    y = compute()  # noqa: E501, TOP999
    ```

    ## Use instead
    ```python
    x = torch.zeros(3, device="cuda")
    y = compute()  # noqa: E501
    ```

    ## Fix safety
    Safe: only the comment changes (the unused codes go; the comment goes when nothing else is left
    of it, the rest of the comment stays). On by default, unlike ruff's `RUF100`, because it only
    ever touches torchopt's own codes.
    """

    code = UNUSED_CODE
    name = "unused-suppression"
    family = FAMILY
    message = "Unused suppression"
    fix_title = "Remove the unused suppression"
    safety = Safety.SAFE
    # The engine reports it from the run's suppressions, after every other rule: nothing to visit.
    locality = "file"

    @classmethod
    def could_match(cls, text: str) -> bool:
        return False

    examples = (
        Invalid("x = 1  # noqa: TOP999\n", after="x = 1\n", note="no rule has this code"),
        Invalid("import os  # noqa: F401, TOP999\n", after="import os  # noqa: F401\n"),
        Invalid("x = 1  # a note  # torchopt: ignore[TOP999]\n", after="x = 1  # a note\n"),
        Valid("import os  # noqa: F401\n", note="another tool's code"),
        Valid("import os  # noqa\n", note="a bare noqa may serve another linter"),
        Valid(
            "import torch\nx = torch.zeros(3).cuda()  # noqa: TOP101\n",
            note="TOP101 is not enabled in this example's run (it selects TOP001 alone)",
        ),
    )
