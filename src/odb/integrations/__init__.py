"""Trainer integrations of odb, one module per framework, each imported only when used.

``import odb`` never imports a training framework: import the module you need, e.g.
``from odb.integrations.hf import enable_odb`` (transformers Trainer),
``from odb.integrations.accelerate import configure_accelerator`` or
``from odb.integrations.lightning import ODBCallback``.
"""
