"""HotpotQA ReAct traces: where the real file comes from, and synthetic traces of the same JSON shape.

The benchmarks that replay ReAct episodes read the traces of SGLang's ReAct benchmark: ``hotpotqa_100.jsonl``
in ``benchmark/react/`` of https://github.com/sgl-project/sglang (100 HotpotQA questions with ReAct
trajectories; HotpotQA is CC BY-SA 4.0). The repository ships no copy: pass the file as ``--data PATH``.
One JSON object per line::

    {"Question: ...": [{"thought": "...", "action": "Search[x]" | "Lookup[x]" | "Finish[x]",
                        "observation": "..."}, ...]}

Without ``--data`` a benchmark replays synthetic traces of that shape (``synthetic_traces``): made-up
towns, people and years in template sentences; 2-5 steps of Search (sometimes a failed one with similar
titles first), Lookup and Finish; about a quarter of the episodes stop before Finish, as in the real file.
Their numbers describe the runtime on that shape, not the model's skill on HotpotQA.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

Step = dict[str, str]
TraceLine = dict[str, list[Step]]  # one line of the file: {"Question: ...": steps}

DATA_SOURCE = (
    "HotpotQA ReAct traces (jsonl): hotpotqa_100.jsonl of SGLang's ReAct benchmark "
    "(github.com/sgl-project/sglang, benchmark/react; HotpotQA, CC BY-SA 4.0)"
)
DATA_HELP = f"{DATA_SOURCE}. Default: synthetic traces of the same shape (benchmarks/react_traces.py)"
SYNTHETIC_TRACES = 100  # as many as the real file

_ROOTS = ["Ash", "Bel", "Cor", "Dun", "Elm", "Fen", "Gal", "Hol", "Ivel", "Kes", "Lor", "Mar", "Nor", "Ost",
          "Pell", "Quen", "Ros", "Sel", "Tarn", "Vel", "Wick", "Yar"]  # fmt: skip
_ENDS = ["ford", "bury", "ton", "mere", "wick", "dale", "field", "haven", "stead", "moor"]
_FIRST = ["Anna", "Bruno", "Clara", "David", "Elena", "Felix", "Greta", "Hugo", "Ines", "Jonas", "Karin",
          "Leon", "Maria", "Niko", "Olga", "Pavel", "Rosa", "Stefan", "Tilda", "Viktor"]  # fmt: skip
_LAST = ["Abel", "Brandt", "Castell", "Dorn", "Eskola", "Falk", "Grau", "Holm", "Janssen", "Kovac", "Lind",
         "Moreau", "Novak", "Ortiz", "Petrov", "Quist", "Ruiz", "Sorensen", "Tamm", "Varga"]  # fmt: skip
_JOBS = ["painter", "composer", "novelist", "architect", "physicist", "film director", "poet", "sculptor"]
_KINDS = ["market town", "village", "port town", "mining town", "cathedral city"]
_REGIONS = ["the northern lowlands", "the river valley", "the eastern hills", "the western coast"]
_SIGHTS = ["a stone bridge", "a clock tower", "a covered market", "an old mill", "a lighthouse"]


def _town(rng: random.Random) -> str:
    return rng.choice(_ROOTS) + rng.choice(_ENDS)


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _town_page(rng: random.Random, town: str, year: int, founder: str) -> str:
    return (
        f"{town} is a {rng.choice(_KINDS)} in {rng.choice(_REGIONS)}. It was founded in {year} by "
        f"{founder}. Its population was {rng.randint(800, 90000):,} at the last census. The town is "
        f"known for {rng.choice(_SIGHTS)} and a yearly fair. {town} lies on the {_town(rng)} road."
    )


def _person_page(rng: random.Random, person: str, job: str, year: int, town: str) -> str:
    return (
        f"{person} (born {year}) is a {job} from {town}. {person.split()[0]} studied in "
        f"{_town(rng)} and first worked as a {rng.choice(_JOBS)}. Their best known work dates from "
        f"{year + rng.randint(20, 40)}. They live in {_town(rng)}."
    )


def _step(thought: str, action: str, observation: str) -> Step:
    return {"thought": thought, "action": action, "observation": observation}


def _founded_first(rng: random.Random) -> tuple[str, list[Step]]:
    """Which of two towns was founded first: search both (the first one perhaps after a miss), finish."""
    a, b = _town(rng), _town(rng)
    while b == a:
        b = _town(rng)
    ya, yb = rng.sample(range(1100, 1900), 2)
    steps = [_step(f"I need to search {a} and {b}, and find which was founded first.", f"Search[{a}]",
                   _town_page(rng, a, ya, _person(rng)))]  # fmt: skip
    if rng.random() < 0.3:
        similar = [f"{b} ({k})" for k in ("town", "river", "station")]
        steps.append(_step(f"{a} was founded in {ya}. I need to search {b} next.", f"Search[{b}]",
                           f"Could not find [{b}]. Similar: {similar}."))  # fmt: skip
        steps.append(_step(f"To find the town, I can search {b} (town).", f"Search[{b} (town)]",
                           _town_page(rng, b, yb, _person(rng))))  # fmt: skip
    else:
        steps.append(_step(f"{a} was founded in {ya}. I need to search {b} next.", f"Search[{b}]",
                           _town_page(rng, b, yb, _person(rng))))  # fmt: skip
    first = a if ya < yb else b
    steps.append(_step(f"{b} was founded in {yb}, so {first} was founded first.", f"Finish[{first}]",
                       _reward(rng)))  # fmt: skip
    return f"Question: Which town was founded first, {a} or {b}?", steps


def _founder_job(rng: random.Random) -> tuple[str, list[Step]]:
    """What the founder of a town did: search the town, look up the founder (perhaps after a miss), search
    the founder, finish."""
    town, founder, job = _town(rng), _person(rng), rng.choice(_JOBS)
    year = rng.randint(1100, 1800)
    page = _town_page(rng, town, year, founder)
    steps = [
        _step(
            f"I need to search {town}, find its founder, then find the founder's profession.",
            f"Search[{town}]",
            page,
        ),
    ]
    missed = rng.random() < 0.5
    if missed:
        steps.append(
            _step(
                "It does not say who the founder was. I need to look up founder.",
                "Lookup[founder]",
                "No more results.",
            )
        )
    steps += [
        _step(f"I need to look up founded{' instead' if missed else ''}.", "Lookup[founded]",
              f"(Result 1 / 1) It was founded in {year} by {founder}."),
        _step(f"{town} was founded by {founder}. I need to search {founder}.", f"Search[{founder}]",
              _person_page(rng, founder, job, rng.randint(1900, 1990), town)),
        _step(f"{founder} is a {job}, so the answer is {job}.", f"Finish[{job}]", _reward(rng)),
    ]  # fmt: skip
    return f"Question: What was the profession of the founder of {town}?", steps


def _reward(rng: random.Random) -> str:
    return f"Episode finished, reward = {int(rng.random() < 0.5)}\n"


def synthetic_traces(n: int = SYNTHETIC_TRACES, seed: int = 0) -> list[TraceLine]:
    """``n`` ReAct traces of the real file's shape (deterministic in ``seed``); one line of the file each."""
    rng = random.Random(seed)
    out: list[TraceLine] = []
    for i in range(n):
        question, steps = (_founded_first if i % 2 == 0 else _founder_job)(rng)
        if i % 4 == 3:  # every fourth episode runs out of steps before Finish (the real file: 29 of 100)
            steps = steps[: rng.randint(2, len(steps) - 1)]
        out.append({question: steps})
    return out


def write_traces(path: Path, traces: list[TraceLine]) -> Path:
    """Write ``traces`` as the real file is written: one JSON object per line."""
    path.write_text("".join(json.dumps(t) + "\n" for t in traces), encoding="utf-8")
    return path


def traces_file(data: Path | None, n: int = SYNTHETIC_TRACES, seed: int = 0) -> Path:
    """``data`` (it must exist), or without it a file of ``synthetic_traces(n, seed)`` in the temp dir
    (the same name for the same content: written to a private name, then renamed into place)."""
    if data is not None:
        if not data.is_file():
            raise FileNotFoundError(f"--data {data}: no such file (expected the {DATA_SOURCE})")
        return data
    path = Path(tempfile.gettempdir()) / f"radixrt-synthetic-react-{n}-{seed}.jsonl"
    fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
    os.close(fd)
    os.replace(write_traces(Path(tmp), synthetic_traces(n, seed)), path)
    return path


def data_label(data: Path | None) -> str:
    """What a result file records as its data: the traces file's name (never its path), or ``synthetic``."""
    return data.name if data is not None else "synthetic"
