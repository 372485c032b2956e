"""The top of the house: the ``kvscope`` command, ``kvscope serve``'s supervisor and the sub-commands that
join layers (``bench --offline`` runs the engine, ``plan --from-log`` reads the gateway's request log).

The only package that may import every layer (kvscope.engine, kvscope.gateway, kvscope.plan, kvscope.bench,
kvscope.common); nothing imports it (import-linter contracts in pyproject.toml).
"""
