"""Communication: the only package that imports ``torch.distributed``.

``dist`` holds the metadata exchange between ranks (an all_gather of small integer arrays
with a status word, so one rank's failure reaches all), its errors (``ODBExchangeError``,
``ODBRankFailed``, ``ODBOptionMismatch``) and the gloo group's lifecycle; ``agreement``
checks that every rank runs with the same options.
"""
