"""Prompt sets for the retrieval, ReFreeKV and InfoKV studies.

Every prompt is a dict: kind, text (the user message), prefix (what the assistant turn
starts with), and what scoring needs (answer). Generation is deterministic: a sample index
seeds everything random, so a rerun builds the same prompts.

  passkey  the classic passkey test: a 5-digit key in repeated filler sentences.
  needle   needle in a haystack of natural prose: "one of the special magic numbers for
           <word> is <7 digits>" inside the Lee corpus at a given depth (RULER's single
           needle, with news articles for haystack as NIAH uses essays).
  summary  one Lee article, "summarize in one sentence" (needs the gist of everything).
  arith    a one-step word problem whose two numbers are far apart in news text (needs the
           few exact tokens that carry the numbers).
"""
import random
import re

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                 "memorize it. I will quiz you about the important information there.\n\n")
WORDS = ["apple", "river", "candle", "mountain", "violin", "harbor", "lantern", "meadow",
         "pepper", "falcon", "marble", "orchid", "thunder", "compass", "velvet", "glacier"]

# Characters per token of each haystack under the SmolLM2 tokenizer (measured with
# `kvmem_worker dump --ids_only`; the worker reports the exact count of every prompt).
CHARS_PER_TOKEN = {"filler": 3.75, "lee": 4.93}


def _cut(text, chars):
    """The first `chars` characters of text, ending at a sentence boundary."""
    piece = text[:chars]
    end = piece.rfind(". ")
    return piece[:end + 1] if end > chars // 2 else piece


def _sentences(corpus, start, chars):
    """About `chars` characters of corpus from the first sentence that starts after `start`."""
    begin = corpus.find(". ", start)
    begin = start if begin < 0 else begin + 2
    return _cut(corpus[begin:begin + chars], chars)


def _insert_at_depth(haystack, needle, depth):
    """Inserts the needle after the sentence that ends nearest to depth * len."""
    at = int(len(haystack) * depth)
    end = haystack.find(". ", at)
    end = len(haystack) if end < 0 else end + 2
    return haystack[:end] + needle + " " + haystack[end:]


def passkey(tokens, depth, sample, cpt=None):
    rng = random.Random(f"passkey-{tokens}-{depth}-{sample}")
    key = rng.randint(10000, 99999)
    chars = int((tokens - 60) * (cpt or CHARS_PER_TOKEN["filler"]))
    hay = (FILLER * (chars // len(FILLER) + 1))[:chars]
    hay = _cut(hay, chars)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    text = PASSKEY_INTRO + _insert_at_depth(hay, needle, depth) + "\n\nWhat is the pass key?"
    return {"kind": "passkey", "text": text, "prefix": "The pass key is", "answer": str(key)}


def needle(tokens, depth, sample, corpus, cpt=None):
    rng = random.Random(f"needle-{tokens}-{depth}-{sample}")
    word = rng.choice(WORDS)
    number = rng.randint(1000000, 9999999)
    chars = int((tokens - 80) * (cpt or CHARS_PER_TOKEN["lee"]))
    start = rng.randrange(0, max(1, len(corpus) - chars - 1))
    start = corpus.find("\n\n", start) + 2 if corpus.find("\n\n", start) >= 0 else 0
    hay = _cut(corpus[start:start + chars], chars)
    sentence = f"One of the special magic numbers for {word} is: {number}."
    text = ("Some special magic numbers are hidden within the following text. Make sure to "
            "memorize them. I will quiz you about the numbers afterwards.\n\n" +
            _insert_at_depth(hay, sentence, depth) +
            f"\n\nWhat is the special magic number for {word} mentioned in the provided text?")
    return {"kind": "needle", "text": text,
            "prefix": f"The special magic number for {word} mentioned in the provided text is",
            "answer": str(number)}


def fitted(build, tokens, count, kind):
    """Rebuilds a prompt with a corrected characters-per-token ratio until its token count
    (count(text), the worker's tokenizer) is within 2 % below `tokens`."""
    cpt = CHARS_PER_TOKEN[kind]
    for _ in range(4):
        p = build(cpt)
        n = count(p["text"])
        if 0.96 * tokens <= n <= tokens:
            break
        cpt *= tokens * 0.98 / n
    p["tokens"] = n
    return p


def retrieval_grid(lengths, depths, samples, corpus, count):
    """samples prompts per (length, depth) cell; passkey and needle alternate by sample.
    `count(text)` gives a text's token count; prompts are fitted to the length."""
    out = []
    for tokens in lengths:
        for depth in depths:
            for s in range(samples):
                if s % 2 == 0:
                    p = fitted(lambda cpt: passkey(tokens, depth, s, cpt), tokens, count, "filler")
                else:
                    p = fitted(lambda cpt: needle(tokens, depth, s, corpus, cpt), tokens, count,
                               "lee")
                p.update({"length": tokens, "depth": depth, "sample": s})
                out.append(p)
    return out


def summary(sample, corpus):
    articles = [a for a in corpus.split("\n\n") if 1500 < len(a) < 4000]
    article = random.Random(f"summary-{sample}").choice(articles)
    return {"kind": "summary", "text": "Summarize the following news article in one sentence.\n\n"
            + article, "prefix": "", "answer": None, "sample": sample}


NAMES = ["Anna", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hiro"]
ITEMS = ["apples", "books", "pencils", "stamps", "marbles", "cookies", "shells", "cards"]


def arith(sample, corpus):
    """A word problem: a + b, the two numbers ~450 tokens apart in news text."""
    rng = random.Random(f"arith-{sample}")
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(10, 40), rng.randint(5, 30)
    start = rng.randrange(0, len(corpus) - 2000)
    pieces = [_sentences(corpus, start + i * 1000, 900) for i in range(2)]
    story = (f"{name} has {a} {item}. {pieces[0]} Later, {name} gets {b} more {item}. "
             f"{pieces[1]}")
    text = (f"{story}\n\nQuestion: How many {item} does {name} have now? Answer with the "
            "number only.")
    return {"kind": "arith", "text": text, "prefix": f"{name} has", "answer": str(a + b),
            "sample": sample}


def numbers_in(answer):
    return re.findall(r"\d+", answer)


def correct(prompt, answer):
    """Retrieval and arithmetic: the first number in the answer is the expected one."""
    found = numbers_in(answer)
    return bool(found) and found[0] == prompt["answer"]


def rouge_l(a, b):
    """ROUGE-L F1 between two texts over lowercase word tokens."""
    x, y = re.findall(r"\w+", a.lower()), re.findall(r"\w+", b.lower())
    if not x or not y:
        return 0.0
    prev = [0] * (len(y) + 1)
    for xi in x:
        cur = [0]
        for j, yj in enumerate(y):
            cur.append(prev[j] + 1 if xi == yj else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(x), lcs / len(y)
    return 2 * p * r / (p + r)
