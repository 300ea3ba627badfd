"""The HTTP process: FastAPI routes, TokenizerManager (tokenize, track, detokenize), worker supervision."""
