"""Agent and RAG benchmark suite: SGLang's benchmark program shapes written in ``frontend_lang``, run
against several systems in one command (``python -m benchmarks.agents``, see ``benchmarks/README.md``).

Layout (one concern per file):

- ``workload.py``: what a workload is (an ``@function`` program + its instances) and the sizes (`Scale`);
- ``react.py``, ``rag.py``, ``multi_turn.py``, ``tot.py``: the workloads; ``data.py``: the HotpotQA
  traces, the BM25 "Wikipedia" and passage corpus built from them, exact match / F1;
- ``backends.py``: the systems (radixrt in-process and over HTTP, radix cache off, fcfs, llama.cpp's
  server, HF transformers, any OpenAI-compatible URL) behind one interface; ``completions.py`` and
  ``hf_backend.py``: the frontend_lang backends the suite adds for them; ``servers.py``: processes;
- ``recorder.py``: a pass-through backend recording every request; ``runner.py``: one run and its
  metrics, including the optimum; ``suite.py``: the loop over systems; ``report.py``: tables, plots.
"""
