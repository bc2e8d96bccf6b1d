"""`torchopt lsp` in Emacs with eglot, configured as docs/editors.md says: Emacs (batch) opens a
file, gets torchopt's diagnostics through Flymake, asks for the quick fixes at the finding, applies
the preferred one, and the buffer holds the fixed text. Skipped where Emacs or eglot is missing
(Debian: apt-get install emacs-nox elpa-eglot; Emacs 29 has eglot built in)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pygls")

from torchopt.rewrite.config import Settings  # noqa: E402
from torchopt.rewrite.engine import fix_source  # noqa: E402

EMACS = shutil.which("emacs")
DOCS = Path(__file__).parent.parent / "docs" / "editors.md"
SRC = "import torch\n\nx = torch.zeros(3).cuda()\ny = 1\n"
# Debian's elpa-* packages are not on the load path under -Q.
LOAD_PATH = [a for d in sorted(glob.glob("/usr/share/emacs/site-lisp/elpa/eglot-*")) for a in ("-L", d)]

DRIVE = r"""
(setq eglot-sync-connect t)
(find-file (getenv "TORCHOPT_FILE"))
(python-mode)
(apply #'eglot (eglot--guess-contact))
(let ((deadline (+ (float-time) 120)))
  (while (and (null (flymake-diagnostics)) (< (float-time) deadline))
    (accept-process-output nil 0.1)))
(let* ((d (or (car (flymake-diagnostics)) (error "no diagnostics")))
       (server (eglot--current-server-or-lose))
       (actions (jsonrpc-request
                 server :textDocument/codeAction
                 (list :textDocument (eglot--TextDocumentIdentifier)
                       :range (list :start (eglot--pos-to-lsp-position (flymake-diagnostic-beg d))
                                    :end (eglot--pos-to-lsp-position (flymake-diagnostic-end d)))
                       :context (list :diagnostics [] :only ["quickfix"]))))
       (fix (or (cl-find-if (lambda (a) (eq (plist-get a :isPreferred) t)) actions)
                (error "no preferred quick fix in %S" actions))))
  (unless (plist-get fix :edit)
    (setq fix (jsonrpc-request server :codeAction/resolve fix)))
  (eglot--apply-workspace-edit (plist-get fix :edit))
  (write-region (point-min) (point-max) (getenv "TORCHOPT_OUT")))
(kill-emacs 0)
"""


def docs_config() -> str:
    """The elisp block of the Emacs section of docs/editors.md."""
    section = DOCS.read_text().split("### Emacs (eglot)", 1)[1]
    return section.split("```elisp\n", 1)[1].split("```", 1)[0]


def has_eglot() -> bool:
    if EMACS is None:
        return False
    probe = [EMACS, "--batch", "-Q", *LOAD_PATH, "--eval", "(require 'eglot)"]
    return subprocess.run(probe, capture_output=True, timeout=60).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not has_eglot(), reason="Emacs with eglot is not installed (apt-get install emacs-nox elpa-eglot)")
def test_emacs_eglot_applies_a_quick_fix(tmp_path):
    assert EMACS is not None
    src = tmp_path / "train.py"
    src.write_text(SRC)
    init = tmp_path / "init.el"
    init.write_text("(require 'eglot)\n" + docs_config() + DRIVE)
    out = tmp_path / "fixed.py"
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = os.path.dirname(sys.executable)  # the `torchopt` command of this environment
    env = {
        **os.environ,
        "HOME": str(home),
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "TORCHOPT_FILE": str(src),
        "TORCHOPT_OUT": str(out),
    }
    assert shutil.which("torchopt", path=env["PATH"]), "no torchopt command next to the interpreter"
    proc = subprocess.run(
        [EMACS, "--batch", "-Q", *LOAD_PATH, "-l", str(init)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    want = fix_source(SRC, Settings()).text
    assert want != SRC
    assert out.read_text() == want
    assert src.read_text() == SRC
