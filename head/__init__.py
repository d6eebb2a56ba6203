"""The head process: receives what the node agents ship, stores it, analyzes it live, serves it, acts on it.

Along the data path:

- ``receiver`` (OTLP/HTTP decoding) and ``api`` (the HTTP server: OTLP endpoints and the JSON API);
- ``ingest`` (decoded requests into the store's queue and the live windows);
- ``store`` (the run store: dedupe, write-ahead log, Parquet part files);
- ``runs`` and ``live`` (each run's live window, fed by the store), ``live_frames`` (the window as DataFrames);
- ``analysis`` (live analysis rounds), ``findings_book`` (findings as episodes), ``policy_runner`` (the
  evict policy), ``actions`` (requests to the agents and their acks);
- ``service`` (``Head``: the parts put together, with their threads) and ``cli`` (``ranksight head``).
"""
