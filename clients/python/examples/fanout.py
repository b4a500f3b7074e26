#!/usr/bin/env python3
"""Fan out: read a document once, then ask several questions about it from
forks that stream at the same time.

Connects to a running daemon (it starts nothing):

    python3 fanout.py [DOCUMENT] [--url URL] [--token TOKEN | --sessions-dir DIR]
                      [--question Q ...] [--max-tokens N]

URL: --url, else SUPERFLUID_URL, else http://127.0.0.1:8460. Token: --token,
else SUPERFLUID_TOKEN, else <sessions dir>/web-token (--sessions-dir, else
SUPERFLUID_SESSIONS, else ~/.superfluid/sessions). Without DOCUMENT it uses a
built-in text of about 2,000 tokens.

The base session holds the document and is prefilled once; each question is
a fork of it, so the document is shared by reference and every fork starts
warm (its warm_prefix counts the prompt tokens that came from the cache).
"""

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from superfluid_client import Client, Sampling  # noqa: E402

# A gazetteer built from a small table: about 2,000 tokens of plain facts.
RIVERS = [
    ("Nile", "Egypt and Sudan", 6650, "the Mediterranean Sea", "the papyrus boats of the pharaohs"),
    ("Amazon", "Brazil and Peru", 6400, "the Atlantic Ocean", "its pink river dolphins"),
    ("Yangtze", "China", 6300, "the East China Sea", "the Three Gorges Dam"),
    ("Mississippi", "the United States", 3730, "the Gulf of Mexico", "the paddle steamers of Mark Twain"),
    ("Yenisei", "Russia and Mongolia", 3487, "the Kara Sea", "its frozen winters"),
    ("Yellow River", "China", 5464, "the Bohai Sea", "the loess silt that colours it"),
    ("Ob", "Russia", 3650, "the Gulf of Ob", "its huge marshy floodplain"),
    ("Congo", "the Democratic Republic of the Congo", 4700, "the Atlantic Ocean", "being the deepest river on Earth"),
    ("Mekong", "six countries of Southeast Asia", 4350, "the South China Sea", "its floating markets"),
    ("Niger", "Mali, Niger and Nigeria", 4180, "the Gulf of Guinea", "its inland delta in Mali"),
    ("Volga", "Russia", 3530, "the Caspian Sea", "being the longest river in Europe"),
    ("Danube", "ten countries of Europe", 2850, "the Black Sea", "flowing through four capital cities"),
    ("Rhine", "Switzerland, Germany and the Netherlands", 1230, "the North Sea", "its castles and vineyards"),
    ("Ganges", "India and Bangladesh", 2525, "the Bay of Bengal", "its sacred ghats at Varanasi"),
    ("Murray", "Australia", 2508, "the Southern Ocean", "its red gum forests"),
    ("Zambezi", "six countries of southern Africa", 2574, "the Indian Ocean", "the Victoria Falls"),
    ("Thames", "England", 346, "the North Sea", "flowing through London"),
    ("Seine", "France", 777, "the English Channel", "the bridges of Paris"),
]


def builtin_document() -> str:
    """The built-in document: a short gazetteer of rivers."""
    parts = ["A short gazetteer of the world's rivers\n"]
    for i, (name, where, km, mouth, known) in enumerate(RIVERS, 1):
        parts.append(
            "{i}. The {name} runs through {where}. It is about {km} kilometres long and empties into {mouth}. "
            "It is best known for {known}. Towns along the {name} depend on it for water, fishing and trade, "
            "and in the dry season its level can fall by several metres. Travellers who visit the {name} "
            "usually come in spring, when the banks are green and the water is high.".format(
                i=i, name=name, where=where, km=km, mouth=mouth, known=known
            )
        )
    parts.append(
        "Of all the rivers listed here, the Nile is the longest and the Thames is the shortest. "
        "The Congo is the deepest, and the Amazon carries the most water."
    )
    return "\n\n".join(parts)


QUESTIONS = [
    "Which river in the document is the longest?",
    "Into which sea does the Volga flow?",
    "What is the Zambezi best known for?",
    "Name two rivers that flow into the North Sea.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("document", nargs="?", help="a text file (default: a built-in gazetteer)")
    ap.add_argument("--url", default=os.environ.get("SUPERFLUID_URL", "http://127.0.0.1:8460"))
    ap.add_argument("--token", default=os.environ.get("SUPERFLUID_TOKEN"))
    ap.add_argument("--sessions-dir", default=os.environ.get("SUPERFLUID_SESSIONS"))
    ap.add_argument("--question", action="append", help="a question (repeatable; default: four built in)")
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()

    if a.document:
        with open(a.document) as f:
            document = f.read()
    else:
        document = builtin_document()
    questions = a.question or QUESTIONS

    sf = Client(a.url, token=a.token, sessions_dir=a.sessions_dir)
    base = sf.session(Sampling(temperature=0.7, seed=1), system="Answer questions about the document in one sentence.")
    doc = base.user("Here is a document.\n\n" + document)
    ack = base.assistant("I have read the document. Ask me about it.")
    # Read it once: a one-token generation prefills the document into the cache.
    t0 = time.time()
    first = base.generate(1)
    print("document: {} tokens, read once in {:.1f}s".format(base.inspect()["tokens"], time.time() - t0))

    answers = [None] * len(questions)
    errors = []

    def ask(i: int, question: str) -> None:
        try:
            fork = base.fork_after(ack, seed=i + 1)      # shares the document by reference
            fork.user(question)
            stream = fork.stream(a.max_tokens)
            text = "".join(chunk.text for chunk in stream if chunk.kind == "text")
            answers[i] = (fork.id, text, stream.reply)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append("{}: {}".format(question, e))

    t0 = time.time()
    threads = [threading.Thread(target=ask, args=(i, q)) for i, q in enumerate(questions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - t0
    for question, answer in zip(questions, answers):
        if answer is None:
            continue
        fork_id, text, reply = answer
        print("\n[session {}] Q: {}\nA: {}\n   (warm_prefix {}, {} tokens, finish {})".format(
            fork_id, question, text.strip(), reply.warm_prefix, reply.tokens, reply.finish))
    print("\n{} questions streamed at the same time in {:.1f}s (base session {}, doc event {}, prefill warm {})".format(
        len(questions), elapsed, base.id, doc.id, first.warm_prefix))
    for e in errors:
        print("error:", e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
