"""Communication between ranks: the exchange protocol apart from its transports.

``protocol`` holds the metadata exchange between ranks (``RankExchange``: an all_gather of small
integer arrays with a status word, so one rank's failure reaches all) and its errors
(``ODBExchangeError``, ``ODBRankFailed``, ``ODBOptionMismatch``), numpy only; ``dist`` its gloo
transport and the groups' lifecycle, the only module of odb that imports ``torch.distributed``;
``threads`` a transport for ranks that are threads of one process (tests); ``agreement`` checks
that every rank runs with the same options.
"""
