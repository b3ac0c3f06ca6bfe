"""The command line: typer commands, one small module per verb; rendering only."""
