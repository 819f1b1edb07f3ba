"""Trainer integrations of odb, one module per framework, each imported only when used.

``odb.enable_odb(trainer, token_budget=...)`` (``odb.integrations.enable``) takes every trainer odb trains
and imports the framework path it takes only when called. ``import odb`` never imports a training framework:
for the other hooks import the module you need, e.g.
``from odb.integrations.accelerate import configure_accelerator`` or
``from odb.integrations.lightning import ODBCallback``.
"""
