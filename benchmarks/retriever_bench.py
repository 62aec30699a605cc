"""Query latency of the BM25 retriever on a generated corpus.

Usage: ``python benchmarks/retriever_bench.py [--docs 10000] [--queries 200] [--repeats 5]``

Builds a corpus of synthetic documents (entity names, attributes and filler words drawn from a fixed
vocabulary, ~40 tokens each, seeded), indexes it, then times ``search(query, k=3)`` one query at a time
and ``search_batch`` over all queries. Prints medians over repeats; also the index build time and a
save/load round trip.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from copc.tools.retriever import BM25Retriever


def make_corpus(num_docs: int, seed: int) -> tuple[list[dict[str, str]], list[tuple[str, str]]]:
    """Rows, and (query, id of the document that answers it) pairs in random order."""
    rng = random.Random(seed)
    filler = [f"word{i}" for i in range(5000)]
    rows, queries = [], []
    for i in range(num_docs):
        name = f"entity{i}"
        attribute = rng.choice(["capital", "founder", "river", "mountain", "author", "color"])
        value = f"value{rng.randrange(100_000)}"
        words = rng.choices(filler, k=35)
        rows.append({"id": str(i), "contents": f"The {attribute} of {name} is {value}. " + " ".join(words)})
        queries.append((f"what is the {attribute} of {name}", str(i)))
    rng.shuffle(queries)
    return rows, queries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--k", type=int, default=3)
    args = parser.parse_args()

    rows, pairs = make_corpus(args.docs, seed=0)
    queries = [query for query, _ in pairs[: args.queries]]
    answer_ids = [doc_id for _, doc_id in pairs[: args.queries]]
    start = time.perf_counter()
    retriever = BM25Retriever.from_rows(rows)
    build_s = time.perf_counter() - start

    single_ms, mean_ms, batch_ms = [], [], []
    for _ in range(args.repeats):
        per_query = []
        for query in queries:
            t0 = time.perf_counter()
            retriever.search(query, args.k)
            per_query.append((time.perf_counter() - t0) * 1e3)
        single_ms.append(statistics.median(per_query))
        mean_ms.append(statistics.fmean(per_query))
        t0 = time.perf_counter()
        retriever.search_batch(queries, args.k)
        batch_ms.append((time.perf_counter() - t0) * 1e3 / len(queries))

    top1 = [hits[0].id if hits else None for hits in retriever.search_batch(queries, 1)]
    correct = sum(got == want for got, want in zip(top1, answer_ids, strict=True))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        retriever.save(tmp)
        loaded = BM25Retriever.load(tmp)
        roundtrip_s = time.perf_counter() - t0
        same = loaded.search_batch(queries, args.k) == retriever.search_batch(queries, args.k)

    print(f"corpus: {args.docs} docs, {len(queries)} queries, k={args.k}, {args.repeats} repeats")
    print(f"index build: {build_s:.2f} s")
    print(
        f"search (one query): median {statistics.median(single_ms):.3f} ms/query, "
        f"mean {statistics.median(mean_ms):.3f} ms/query (medians over repeats)"
    )
    print(f"search_batch: mean {statistics.median(batch_ms):.3f} ms/query (median over repeats)")
    print(f"top-1 is the document about the queried entity: {correct}/{len(queries)}")
    print(f"save + load: {roundtrip_s:.2f} s, identical results after load: {same}")


if __name__ == "__main__":
    main()
