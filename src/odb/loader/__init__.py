"""The facade: ``ODBDataLoader`` (a ``torch.utils.data.DataLoader``), ``odb.apply`` for an
existing loader, the length probe behind ``len()``, and the checks on the batches the
training loop receives."""
