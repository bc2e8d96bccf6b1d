"""The rewrite engine: discovery, configuration, suppressions, fix application, diffs, writes and
reports. It knows no rule (rules live in ``torchopt.codemods``) and never imports torch."""
