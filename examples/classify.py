"""Structured answers from the chat model: classify reviews with ``select``, rate them with a regex.

``python examples/classify.py`` — a few labelled reviews are earlier chat turns (shared by every request,
so computed once); for each new review ``select`` scores every label in one batched prefill-only request
(the answer is always one of the labels) and the rating is a ``gen`` forced to match ``[1-5]``.
"""

from __future__ import annotations

import time
from typing import Any

from common import cache_counters, make_backend, parse_args, print_cache_stats

import frontend_lang as sgl

REVIEWS = [
    "The battery died after two days and support never answered my emails.",
    "Absolutely love this little speaker, the sound is warm and clear.",
    "The hotel room was clean, but the breakfast was cold and the staff rude.",
    "Best pizza I have had in years, we will definitely come back!",
    "The train was two hours late and nobody told us why.",
    "My new laptop is fast and the screen is gorgeous.",
]
SENTIMENTS = ["positive", "negative"]
TOPICS = ["electronics", "travel", "food"]
EXAMPLES = [  # (review, sentiment, topic, rating): the few-shot turns
    ("The headphones broke after a week.", "negative", "electronics", "1"),
    ("Our flight was smooth and the crew was lovely.", "positive", "travel", "5"),
    ("The soup was bland and the bread stale.", "negative", "food", "2"),
]


@sgl.function
def classify(s: Any, review: str) -> dict[str, str]:
    s += sgl.system("Classify each review: its sentiment, its topic and a rating from 1 to 5.")
    for text, sentiment, topic, rating in EXAMPLES:
        s += sgl.user(f"Review: {text}")
        s += sgl.assistant(f"Sentiment: {sentiment}\nTopic: {topic}\nRating: {rating}")
    s += sgl.user(f"Review: {review}")
    s += sgl.assistant(
        "Sentiment: "
        + sgl.select("sentiment", choices=SENTIMENTS)
        + "\nTopic: "
        + sgl.select("topic", choices=TOPICS)
        + "\nRating: "
        + sgl.gen("rating", max_tokens=2, regex="[1-5]")
    )
    return {"sentiment": s["sentiment"], "topic": s["topic"], "rating": s["rating"]}


def run(backend: sgl.BaseBackend) -> None:
    """Classify every review and print the answers: select and a greedy regex gen, one review at a time
    (concurrent reviews batch differently from run to run), so the same text every run."""
    states = classify.run_batch(
        [{"review": r} for r in REVIEWS], backend=backend, temperature=0, num_threads=1, progress_bar=True
    )
    print(f"\n{'sentiment':>9} {'topic':>11} rating  review")
    for review, st in zip(REVIEWS, states, strict=True):
        if st.error() is not None:
            print(f"  error {st.error()!r}: {review}")
            continue
        r = st.ret_value
        print(f"{r['sentiment']:>9} {r['topic']:>11} {r['rating']:>6}  {review}")


def main() -> None:
    ns = parse_args(__doc__)
    backend = make_backend(ns)
    before, started = cache_counters(backend), time.perf_counter()
    run(backend)
    print_cache_stats(backend, started, before)
    backend.shutdown()


if __name__ == "__main__":
    main()
