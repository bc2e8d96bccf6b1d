// The extension's settings, turned into the server command and the server's initialization options.
// Pure functions: no `vscode` import, so they run (and are tested) outside VS Code.

/** The pip requirement that installs the language server; the one place it is named. */
export const PIP_REQUIREMENT = "torchopt-rewrite[lsp]";

/** The `torchopt.*` settings as VS Code reports them (any value may be missing or of a wrong type). */
export interface RawSettings {
  path?: unknown;
  interpreter?: unknown;
  args?: unknown;
  select?: unknown;
  ignore?: unknown;
  unsafeFixes?: unknown;
  debounceMs?: unknown;
  ruleUrl?: unknown;
}

/** What `initializationOptions` (and `workspace/didChangeConfiguration`) carry; see docs/editors.md. */
export interface InitializationOptions {
  select?: string[];
  ignore?: string[];
  unsafeFixes?: boolean;
  debounceMs?: number;
  ruleUrl?: string;
}

export interface ServerCommand {
  command: string;
  args: string[];
}

export const DEFAULT_ARGS: readonly string[] = ["lsp"];

function nonEmptyString(value: unknown): string | undefined {
  return typeof value === "string" && value.trim() !== "" ? value.trim() : undefined;
}

function selectors(value: unknown): string[] | undefined {
  const list = typeof value === "string" ? value.split(",") : value;
  if (!Array.isArray(list)) {
    return undefined;
  }
  const out = list.filter((v): v is string => typeof v === "string").map((v) => v.trim()).filter((v) => v !== "");
  return out.length > 0 ? out : undefined;
}

/**
 * The server's initialization options: only the settings the user set. An unset (or empty) value is
 * left out so that the project's `[tool.torchopt]` table decides; the server checks the values.
 */
export function initializationOptions(raw: RawSettings): InitializationOptions {
  const out: InitializationOptions = {};
  const select = selectors(raw.select);
  if (select !== undefined) {
    out.select = select;
  }
  const ignore = selectors(raw.ignore);
  if (ignore !== undefined) {
    out.ignore = ignore;
  }
  if (typeof raw.unsafeFixes === "boolean") {
    out.unsafeFixes = raw.unsafeFixes;
  }
  if (typeof raw.debounceMs === "number") {
    out.debounceMs = raw.debounceMs;
  }
  const ruleUrl = nonEmptyString(raw.ruleUrl);
  if (ruleUrl !== undefined) {
    out.ruleUrl = ruleUrl;
  }
  return out;
}

function argList(value: unknown): string[] {
  if (!Array.isArray(value) || value.length === 0 || !value.every((v) => typeof v === "string")) {
    return [...DEFAULT_ARGS];
  }
  return [...value];
}

/**
 * How to start the server: `torchopt.path` when set; else `torchopt.interpreter`, else the
 * interpreter the Python extension selected for the workspace, else `fallbackPython`, each run as
 * `PYTHON -m torchopt`. `torchopt.args` replaces the arguments (default `lsp`).
 */
export function serverCommand(raw: RawSettings, workspacePython: string | undefined, fallbackPython: string): ServerCommand {
  const args = argList(raw.args);
  const path = nonEmptyString(raw.path);
  if (path !== undefined) {
    return { command: path, args };
  }
  const python = nonEmptyString(raw.interpreter) ?? nonEmptyString(workspacePython) ?? fallbackPython;
  return { command: python, args: ["-m", "torchopt", ...args] };
}

/** Whether a settings change needs a new server process (rather than a settings notification). */
export function needsRestart(before: RawSettings, after: RawSettings): boolean {
  return (
    nonEmptyString(before.path) !== nonEmptyString(after.path) ||
    nonEmptyString(before.interpreter) !== nonEmptyString(after.interpreter) ||
    JSON.stringify(argList(before.args)) !== JSON.stringify(argList(after.args))
  );
}

/** The message shown when the server cannot start. */
export function cannotStartMessage(cmd: ServerCommand, error: string): string {
  const shown = [cmd.command, ...cmd.args].join(" ");
  return (
    `torchopt: cannot start the language server (\`${shown}\`): ${error}. ` +
    `Install it in the workspace's environment with \`pip install '${PIP_REQUIREMENT}'\`, ` +
    "or set `torchopt.path` or `torchopt.interpreter`."
  );
}
