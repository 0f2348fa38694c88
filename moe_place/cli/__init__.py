"""The `moe-place` command line: a thin shell over the library (one module per subcommand)."""
