// Starts `torchopt lsp` for Python files and keeps its settings in step with VS Code's.

import * as vscode from "vscode";
import {
  DidChangeConfigurationNotification,
  LanguageClient,
  type LanguageClientOptions,
  type ServerOptions,
  TransportKind,
} from "vscode-languageclient/node";
import { cannotStartMessage, initializationOptions, needsRestart, type RawSettings, serverCommand } from "./settings";

const SECTION = "torchopt";
const KEYS: (keyof RawSettings)[] = ["path", "interpreter", "args", "select", "ignore", "unsafeFixes", "debounceMs", "ruleUrl"];

let client: LanguageClient | undefined;
let current: RawSettings = {};

function readSettings(): RawSettings {
  const config = vscode.workspace.getConfiguration(SECTION);
  const out: RawSettings = {};
  for (const key of KEYS) {
    out[key] = config.get<unknown>(key);
  }
  return out;
}

/** The interpreter the Python extension selected for the first workspace folder, if it is installed. */
async function workspacePython(): Promise<string | undefined> {
  const ext = vscode.extensions.getExtension("ms-python.python");
  if (ext === undefined) {
    return undefined;
  }
  try {
    const api: unknown = ext.isActive ? ext.exports : await ext.activate();
    const resource = vscode.workspace.workspaceFolders?.[0]?.uri;
    const envs = (api as { environments?: PythonEnvironments } | undefined)?.environments;
    if (envs !== undefined) {
      const env = await envs.resolveEnvironment(envs.getActiveEnvironmentPath(resource));
      return env?.executable.uri?.fsPath;
    }
  } catch (error) {
    console.warn(`torchopt: the Python extension did not give an interpreter: ${String(error)}`);
  }
  return undefined;
}

interface PythonEnvironments {
  getActiveEnvironmentPath(resource?: vscode.Uri): { id: string; path: string };
  resolveEnvironment(env: { id: string; path: string }): Promise<{ executable: { uri?: vscode.Uri } } | undefined>;
}

async function start(context: vscode.ExtensionContext): Promise<void> {
  current = readSettings();
  const fallback = process.platform === "win32" ? "python" : "python3";
  const cmd = serverCommand(current, await workspacePython(), fallback);
  const cwd = vscode.workspace.workspaceFolders?.[0]?.uri.fsPath;
  const serverOptions: ServerOptions = {
    command: cmd.command,
    args: cmd.args,
    transport: TransportKind.stdio,
    options: cwd === undefined ? {} : { cwd },
  };
  const clientOptions: LanguageClientOptions = {
    documentSelector: [
      { scheme: "file", language: "python" },
      { scheme: "untitled", language: "python" },
    ],
    // The server asks VS Code to watch pyproject.toml files itself (dynamic registration).
    initializationOptions: initializationOptions(current),
  };
  const next = new LanguageClient("torchopt", "torchopt", serverOptions, clientOptions);
  try {
    await next.start();
  } catch (error) {
    void vscode.window.showErrorMessage(cannotStartMessage(cmd, String(error)));
    return;
  }
  client = next;
  context.subscriptions.push(next);
}

async function stop(): Promise<void> {
  const old = client;
  client = undefined;
  if (old !== undefined) {
    await old.stop();
  }
}

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  context.subscriptions.push(
    vscode.workspace.onDidChangeConfiguration(async (event) => {
      if (!event.affectsConfiguration(SECTION)) {
        return;
      }
      const after = readSettings();
      if (client === undefined || needsRestart(current, after)) {
        await stop();
        await start(context);
        return;
      }
      current = after;
      await client.sendNotification(DidChangeConfigurationNotification.type, {
        settings: { torchopt: initializationOptions(after) },
      });
    }),
    vscode.commands.registerCommand("torchopt.restart", async () => {
      await stop();
      await start(context);
    }),
  );
  await start(context);
}

export async function deactivate(): Promise<void> {
  await stop();
}
