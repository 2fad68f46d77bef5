from runner.cli import entry

entry()
