"""One module per `kvguard` subcommand; see kvguard.cli."""
