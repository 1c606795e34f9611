"""The challenge's record: the code counted against the budget, that is the modules a
record run imports (`codesize`), packed into one runnable archive (`archive`; `strip` leaves
their comments and docstrings out when asked, `module_stream` puts them into one lzma stream
and imports them from it), and the report that checks a `make record` run against the rules
(`rules`).

May import: ground, storage.
"""
