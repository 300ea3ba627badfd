"""The link between the TokenizerManager and the worker: wire messages, ZeroMQ client, worker process entry, in-process thread."""
