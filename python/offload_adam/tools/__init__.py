"""The ``python -m offload_adam`` commands: ``plan`` (``plan.py``), ``env`` (``env.py``) and
``bench`` (``bench.py`` and its parts); ``__main__.py`` lists them."""
