"""vkv's lab: the harnesses that measure vkv against other KV caches, run from a checkout
(``python -m lab.serving``, ``python -m lab.multi_engine``); not part of the installed package.
lab/README.md maps it."""
