"""windowgpt: train tiny, strong language models under a hard size budget.

The package is folders by concern over a few ground modules; docs/architecture.md draws
them. The ground: `errors` (what a user can get wrong), `challenge` (the record's limits),
`config` (every setting, its help and bounds, the presets), `runtime` (devices, precision,
compilation), `distributed` (torchrun's process groups), `timing` (where a command's time
goes), `entry` (a command's first and last steps) and `bytecode` (Python's bytecode, kept
where the environment forbids writing it). Each folder's docstring says what
it holds and what it may import; tests/test_layers.py holds the package to it.

May import: ground.
"""

__version__ = "0.1.0"
