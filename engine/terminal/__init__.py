"""The headless CLI's subcommands and flags, and its terminal-safe output."""
