"""Prefill/decode disaggregation in SGLang's design (``--disaggregation-mode prefill|decode``).

sglang-router in PD mode sends each request to a prefill and a decode server with the same
``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``. The decode server asks the prefill server's
bootstrap server (``bootstrap``) where its worker listens, reserves KV slots and sends their indices
(``messages.KVRequest``); the prefill server computes the prompt, writes the pages into those slots through
a transfer backend (``transfer``: Mooncake or the in-message ``fake``) and answers with the first token
(``messages.KVDone``); the decode server then generates. ``prefill`` and ``decode`` hold the two sides'
request flows, which the worker's scheduler calls.
"""
