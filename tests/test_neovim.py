"""`torchopt lsp` in a real editor: Neovim's built-in LSP client (headless, the distribution's
`neovim` package) opens a file, gets torchopt's diagnostics, asks for the code actions at the
finding, applies the quick fix, writes the buffer, and the file holds the fixed text."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("pygls")

from torchopt.rewrite.config import Settings  # noqa: E402
from torchopt.rewrite.engine import fix_source  # noqa: E402

NVIM = shutil.which("nvim")
SRC = "import torch\n\nx = torch.zeros(3).cuda()\ny = 1\n"

# Works on Neovim 0.7 (Debian 12) and later: start_client/buf_attach_client, a codeAction request
# by hand, `codeAction/resolve` when the server sends the edit lazily. Any failure is written to
# the status file and Neovim quits.
INIT_LUA = r"""
local env = vim.env
local function run()
  local client_id = vim.lsp.start_client({
    name = "torchopt",
    cmd = { env.TORCHOPT_PYTHON, "-m", "torchopt", "lsp" },
    root_dir = env.TORCHOPT_ROOT,
    init_options = { select = { "TOP1" }, debounceMs = 0 },
  })
  assert(client_id, "the language server did not start")
  vim.cmd("edit " .. vim.fn.fnameescape(env.TORCHOPT_FILE))
  vim.lsp.buf_attach_client(0, client_id)
  assert(vim.wait(60000, function() return #vim.diagnostic.get(0) > 0 end, 50), "no diagnostics")
  local d = vim.diagnostic.get(0)[1]
  assert(d.source == "torchopt", "diagnostic from " .. tostring(d.source))
  local client = vim.lsp.get_client_by_id(client_id)
  local params = {
    textDocument = { uri = vim.uri_from_bufnr(0) },
    range = { start = { line = d.lnum, character = d.col }, ["end"] = { line = d.end_lnum, character = d.end_col } },
    context = { diagnostics = {}, only = { "quickfix" } },
  }
  local replies = vim.lsp.buf_request_sync(0, "textDocument/codeAction", params, 60000)
  local chosen
  for _, reply in pairs(replies or {}) do
    assert(not reply.err, vim.inspect(reply.err))
    for _, action in ipairs(reply.result or {}) do
      if action.isPreferred then chosen = action end
    end
  end
  assert(chosen, "no preferred quick fix: " .. vim.inspect(replies))
  if not chosen.edit then
    local resolved = client.request_sync("codeAction/resolve", chosen, 60000, 0)
    assert(resolved and not resolved.err, "resolve failed: " .. vim.inspect(resolved))
    chosen = resolved.result
  end
  vim.lsp.util.apply_workspace_edit(chosen.edit, client.offset_encoding)
  vim.cmd("write! " .. vim.fn.fnameescape(env.TORCHOPT_OUT))
  return chosen.title
end
local ok, result = pcall(run)
local status = io.open(env.TORCHOPT_STATUS, "w")
status:write(ok and ("OK " .. result) or ("FAILED " .. tostring(result)))
status:close()
vim.cmd("qa!")
"""


@pytest.mark.slow
@pytest.mark.skipif(NVIM is None, reason="nvim is not installed (apt-get install neovim; .ci/run installs it)")
def test_neovim_applies_a_quick_fix(tmp_path):
    assert NVIM is not None
    src = tmp_path / "train.py"
    src.write_text(SRC)
    init = tmp_path / "init.lua"
    init.write_text(INIT_LUA)
    out, status = tmp_path / "fixed.py", tmp_path / "status.txt"
    home = tmp_path / "home"
    home.mkdir()
    env = {
        **os.environ,
        "HOME": str(home),  # no user configuration, plugins or shada
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "TORCHOPT_PYTHON": sys.executable,
        "TORCHOPT_ROOT": str(tmp_path),
        "TORCHOPT_FILE": str(src),
        "TORCHOPT_OUT": str(out),
        "TORCHOPT_STATUS": str(status),
    }
    proc = subprocess.run(
        [NVIM, "--headless", "-n", "-i", "NONE", "-u", str(init)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    report = status.read_text() if status.exists() else f"no status (nvim exited {proc.returncode}): {proc.stderr}"
    assert report.startswith("OK "), report
    want = fix_source(SRC, Settings(select=("TOP1",))).text
    assert want != SRC
    assert out.read_text() == want
    assert src.read_text() == SRC  # the server never writes the file; Neovim wrote the copy
