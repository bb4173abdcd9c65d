"""The `verispec` command line: entry point `verispec.cli.main:main` (also `python -m verispec.cli`).

- `main`: the commands (generate, chat, serve, bench, plugins, cache), each importing torch only when it
  runs, and the exit statuses (bad input 1, bad flags 2, a bug 70, Ctrl-C 130).
- `flags`: the parser (`build_parser`), the removed flag spellings with their replacement, and the
  checks of text arguments.
- `plugin_listing`: the text `verispec plugins` prints: the table of the registry's rows
  (`format_plugin_table`) and the `--check` report (`format_check`).
- `__main__`: `python -m verispec.cli`.

What a command does lives elsewhere (`verispec.api`, `verispec.bench`, `verispec.chat.repl`,
`verispec.server`); these modules only wire arguments to it.
"""
