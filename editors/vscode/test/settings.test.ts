// Unit tests of the settings mapping (node's test runner on the compiled JavaScript: `npm test`).

import * as assert from "node:assert/strict";
import { test } from "node:test";
import {
  cannotStartMessage,
  initializationOptions,
  needsRestart,
  PIP_REQUIREMENT,
  serverCommand,
} from "../src/settings";

// What VS Code reports for a user who changed nothing (the defaults of package.json).
const DEFAULTS = {
  path: "",
  interpreter: "",
  args: ["lsp"],
  select: null,
  ignore: [],
  unsafeFixes: null,
  debounceMs: 50,
  ruleUrl: "",
};

test("defaults send only the debounce: the project's pyproject.toml decides the rest", () => {
  assert.deepEqual(initializationOptions(DEFAULTS), { debounceMs: 50 });
});

test("each server option is passed under the server's own key", () => {
  const got = initializationOptions({
    ...DEFAULTS,
    select: ["TOP1", " TOP201 "],
    ignore: ["TOP105"],
    unsafeFixes: false,
    debounceMs: 0,
    ruleUrl: "https://docs.example/{code}.html",
  });
  assert.deepEqual(got, {
    select: ["TOP1", "TOP201"],
    ignore: ["TOP105"],
    unsafeFixes: false,
    debounceMs: 0,
    ruleUrl: "https://docs.example/{code}.html",
  });
});

test("a comma-separated string of selectors is a list; empty lists and blank entries are unset", () => {
  assert.deepEqual(initializationOptions({ select: "TOP1, TOP2,", ignore: [] }), { select: ["TOP1", "TOP2"] });
  assert.deepEqual(initializationOptions({ select: [" ", ""], ignore: [42, "TOP101"] }), { ignore: ["TOP101"] });
});

test("values of the wrong type are left out (the server keeps its defaults)", () => {
  assert.deepEqual(initializationOptions({ select: 3, unsafeFixes: "yes", debounceMs: "50", ruleUrl: 7 }), {});
});

test("the server command: torchopt.path first", () => {
  assert.deepEqual(serverCommand({ ...DEFAULTS, path: "/venv/bin/torchopt", interpreter: "/usr/bin/python3" }, "/ws/.venv/bin/python", "python3"), {
    command: "/venv/bin/torchopt",
    args: ["lsp"],
  });
});

test("the server command: the configured interpreter, then the workspace's, then the fallback", () => {
  assert.deepEqual(serverCommand({ ...DEFAULTS, interpreter: "/opt/py/bin/python" }, "/ws/.venv/bin/python", "python3"), {
    command: "/opt/py/bin/python",
    args: ["-m", "torchopt", "lsp"],
  });
  assert.deepEqual(serverCommand(DEFAULTS, "/ws/.venv/bin/python", "python3"), {
    command: "/ws/.venv/bin/python",
    args: ["-m", "torchopt", "lsp"],
  });
  assert.deepEqual(serverCommand(DEFAULTS, undefined, "python3"), { command: "python3", args: ["-m", "torchopt", "lsp"] });
});

test("torchopt.args replaces the arguments; an empty or malformed list means the default", () => {
  assert.deepEqual(serverCommand({ path: "uvx", args: ["torchopt", "lsp"] }, undefined, "python3"), {
    command: "uvx",
    args: ["torchopt", "lsp"],
  });
  assert.deepEqual(serverCommand({ path: "torchopt", args: [] }, undefined, "python3").args, ["lsp"]);
  assert.deepEqual(serverCommand({ path: "torchopt", args: [1] }, undefined, "python3").args, ["lsp"]);
});

test("only a change of the command restarts the server; rule settings go by notification", () => {
  assert.equal(needsRestart(DEFAULTS, { ...DEFAULTS, select: ["TOP1"], debounceMs: 10 }), false);
  assert.equal(needsRestart(DEFAULTS, { ...DEFAULTS, interpreter: "/usr/bin/python3" }), true);
  assert.equal(needsRestart(DEFAULTS, { ...DEFAULTS, path: "torchopt" }), true);
  assert.equal(needsRestart(DEFAULTS, { ...DEFAULTS, args: ["lsp", "-v"] }), true);
  assert.equal(needsRestart(DEFAULTS, { ...DEFAULTS, args: [] }), false); // [] means the default
});

test("the start-up error says what ran and how to install the server", () => {
  const msg = cannotStartMessage({ command: "python3", args: ["-m", "torchopt", "lsp"] }, "exited with 1");
  assert.match(msg, /`python3 -m torchopt lsp`/);
  assert.ok(msg.includes(`pip install '${PIP_REQUIREMENT}'`));
});
