"""Judges for WILD answers: ``rule`` (offline, deterministic) and ``openai`` (LLM-as-a-judge).

Both follow the paper's grader rubric (appendix, "Prompt for LLM-as-a-Judge"): a predicted answer
is CORRECT when it fully contains the important information of the gold target and contains no
information contradicting it; an answer that contradicts the gold target or repeats content is
INCORRECT.

``rule`` implements that rubric with normalised string matching:

* containment — every content word of the gold target (lower-cased, punctuation, articles and
  possessive 's removed, number words mapped to digits) appears in the answer ("sasha and malia
  obama" contains "Malia Obama and Sasha Obama"); a paraphrase or abbreviation ("USA" for "United
  States") is not recognised;
* contradiction — the answer negates the gold ("not X", "isn't X"); or lists another name next to
  it or offers one as an alternative (a capitalised word or number joined to the gold by "and",
  "or", ",", "/": "Malia, Sasha, and Susan", "X or Y"); or, for a numeric gold, contains another
  number. Extra detail that is not coordinated with the answer ("The Chichester River in New
  South Wales") is not a contradiction;
* repetition — the gold target occurs more than once, any run of two or more words repeats back to
  back ("Malia and Sasha, Malia and Sasha"), or one word three times in a row.

``openai`` sends the paper's grader prompt to any OpenAI-compatible ``/chat/completions`` endpoint:
``CRISPEDIT_JUDGE_BASE_URL`` (default ``OPENAI_BASE_URL`` or https://api.openai.com/v1),
``CRISPEDIT_JUDGE_MODEL`` (default gpt-4o-mini) and the key from ``CRISPEDIT_JUDGE_API_KEY`` or
``OPENAI_API_KEY``. Only a reply "A" counts as correct. The key is never printed or written.
"""

from __future__ import annotations

import json
import os
import re
import time
import unicodedata
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import CrispEditError

__all__ = [
    "Judgement",
    "RuleJudge",
    "OpenAIJudge",
    "make_judge",
    "normalize_answer",
    "mentions",
    "GRADER_PROMPT",
    "parse_grade",
    "JUDGES",
]

JUDGES = ("rule", "openai")

# The paper's grader prompt (appendix, Figure "Prompt for LLM-as-a-Judge"), verbatim in content.
GRADER_PROMPT = """Your job is to look at a question, a gold target, and a predicted answer, and then assign a grade of either ["CORRECT", "INCORRECT"].

The following are examples of CORRECT predicted answers.
```
Question: What are the names of Barack Obama's children?
Gold target: Malia Obama and Sasha Obama
Predicted answer 1: sasha and malia obama
Predicted answer 2: Malia and Sasha Obama are the names of Barack Obama's children.
```
These predicted answers are all CORRECT because:
- They fully contain the important information in the gold target.
- They do not contain any information that contradicts the gold target.

The following are examples of INCORRECT predicted answers.
```
Question: What are the names of Barack Obama's children?
Gold target: Malia and Sasha
Predicted answer 1: Malia.
Predicted answer 2: Malia, Sasha, and Susan.
Predicted answer 3: Malia and Sasha, Malia and Sasha, Malia and Sasha, Malia and Sasha (repeated answer)
```
These predicted answers are all INCORRECT because:
- A factual statement in the answer contradicts the gold target or contains repeated content.

Here is a sample. Simply reply with either CORRECT or INCORRECT.
```
Question: {question}
Gold target: {target}
Predicted answer: {predicted_answer}
```
According to the gold target, please grade the predicted answer of this question as one of:
A: CORRECT
B: INCORRECT

Just return the letters "A" or "B", with no text around it."""  # noqa: E501 (the paper's prompt, verbatim)


@dataclass
class Judgement:
    """A judge's verdict on one answer: ``correct`` and a short ``reason``."""

    correct: bool
    reason: str  # rule: contained / missing / contradiction / repetition / empty; openai: the raw reply


# ----------------------------------------------------------------------------------------- rule

_ARTICLES = {"a", "an", "the"}
_STOP = _ARTICLES | {
    "and",
    "or",
    "of",
    "in",
    "on",
    "at",
    "to",
    "for",
    "by",
    "with",
    "from",
    "is",
    "was",
    "are",
    "were",
    "be",
    "it",
    "its",
    "this",
    "that",
    "as",
    "s",
}
_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen twenty".split()
    )
}
_NEGATIONS = {"not", "no", "never", "neither", "nor", "isn't", "wasn't", "aren't", "weren't"}
# words/punctuation that put two answers side by side: "X and Y", "X, Y", "X or Y", "X/Y"
_COORD = {",", ";", "/", "&", "+", "and", "or", "nor", "plus"}
# capitalised words that do not name anything (sentence openers, pronouns)
_NOT_NAMES = {
    "yes",
    "no",
    "well",
    "sure",
    "ok",
    "okay",
    "answer",
    "i",
    "it",
    "he",
    "she",
    "they",
    "we",
    "you",
    "this",
    "that",
    "there",
    "these",
    "those",
    "his",
    "her",
    "their",
    "its",
    "my",
    "our",
    "your",
    "both",
    "either",
    "neither",
}
_TOKEN_RE = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z]+)?|[,;/&+]")


def _fold(text: str) -> str:
    text = text.replace("\u2019", "'").replace("\u2018", "'")
    text = unicodedata.normalize("NFKD", text)
    return "".join(c for c in text if not unicodedata.combining(c))


def _norm(tok: str) -> str:
    t = tok.lower()
    if t.endswith("'s"):  # possessive: "Obama's" names Obama
        t = t[:-2]
    return _NUMBER_WORDS.get(t, t)


def _tokens(text: str) -> list[tuple[str, str]]:
    """(raw, normalised) word and coordinating-punctuation tokens of ``text``."""
    return [(m.group(0), _norm(m.group(0))) for m in _TOKEN_RE.finditer(_fold(text))]


def _words(text: str) -> list[str]:
    """Lower-cased word tokens with punctuation removed, possessives stripped, number words as digits."""
    return [n for raw, n in _tokens(text) if raw[0].isalnum() and n]


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, number words as digits, single spaces."""
    return " ".join(t for t in _words(text) if t not in _ARTICLES)


def mentions(text: str, gold: str) -> bool:
    """Whether ``text`` names ``gold``: every content word of ``gold`` (normalised as the rule judge does) is a
    word of ``text`` — the rule judge's containment test alone, without its contradiction and repetition rules."""
    gold_words = [w for w in _words(gold) if w not in _ARTICLES]
    need = _content(gold_words) or gold_words
    return bool(need) and set(need) <= set(_words(text))


def _content(words: Sequence[str]) -> list[str]:
    return [w for w in words if w not in _STOP]


def _has_repetition(words: Sequence[str], gold: Sequence[str]) -> bool:
    n = len(words)
    if gold:
        g = len(gold)
        hits = sum(1 for i in range(n - g + 1) if list(words[i : i + g]) == list(gold))
        if hits > 1:
            return True
    for size in range(1, n // 2 + 1):  # a run of `size` words immediately repeated
        need = 3 if size == 1 else 2  # single words: allow one doubling ("very very", "Walla Walla")
        for i in range(n - size * need + 1):
            chunk = words[i : i + size]
            if all(words[i + k * size : i + (k + 1) * size] == chunk for k in range(1, need)):
                return True
    return False


def _gold_span(toks: Sequence[tuple[str, str]], gold: set[str]) -> tuple[int, int]:
    """Smallest token window [s, e] holding every gold content word (all are known to be present)."""
    pos = [i for i, (_, n) in enumerate(toks) if n in gold]
    best = (pos[0], pos[-1])
    for a, s in enumerate(pos):
        seen: set[str] = set()
        for e in pos[a:]:
            seen.add(toks[e][1])
            if len(seen) == len(gold):
                if e - s < best[1] - best[0]:
                    best = (s, e)
                break
    return best


def _is_name(raw: str, norm: str) -> bool:
    return bool(raw) and (raw[0].isdigit() or raw[0].isupper()) and norm not in _NOT_NAMES


def _new_name(toks: Sequence[tuple[str, str]], allowed: set[str]) -> bool:
    """A run of capitalised words / numbers that holds a word of neither the question nor the gold."""
    return any(n not in allowed and n not in _STOP for _, n in toks)


def _coordinated_name(toks: Sequence[tuple[str, str]], s: int, e: int, allowed: set[str]) -> bool:
    """Another name listed next to the gold answer or offered as an alternative to it
    ("Malia, Sasha, and Susan", "Chichester River or Hunter River", "Susan, Malia and Sasha"),
    or a new name inside the gold's own span ("Malia, Susan and Sasha")."""
    inside = [t for t in toks[s : e + 1] if t[0][0].isalnum() and _is_name(*t)]
    if _new_name(inside, allowed):
        return True
    n = len(toks)
    j, coord = e + 1, False
    while j < n and toks[j][1] in _COORD:
        j, coord = j + 1, True
    while j < n and toks[j][1] in _ARTICLES:
        j += 1
    run = []
    while coord and j < n and toks[j][0][0].isalnum() and _is_name(*toks[j]):
        run.append(toks[j])
        j += 1
    if _new_name(run, allowed):
        return True
    i = s - 1
    while i >= 0 and toks[i][1] in _ARTICLES:
        i -= 1
    coord = False
    while i >= 0 and toks[i][1] in _COORD:
        i, coord = i - 1, True
    run = []
    while coord and i >= 0 and toks[i][0][0].isalnum() and _is_name(*toks[i]):
        run.append(toks[i])
        i -= 1
    return _new_name(run, allowed)


class RuleJudge:
    """Deterministic offline grader following the paper's rubric (see module docstring)."""

    name = "rule"

    def grade(self, question: str, gold: str, predicted: str) -> Judgement:
        """Whether ``predicted`` states ``gold`` as the answer to ``question`` (rule rubric, offline)."""
        toks = _tokens(predicted)
        pred_words = [n for raw, n in toks if raw[0].isalnum()]
        gold_words = [w for w in _words(gold) if w not in _ARTICLES]
        if not pred_words:
            return Judgement(False, "empty")
        gold_content = _content(gold_words) or gold_words
        if not gold_content:
            return Judgement(False, "missing")
        if _has_repetition([w for w in pred_words if w not in _ARTICLES], gold_words):
            return Judgement(False, "repetition")
        if not set(gold_content) <= set(pred_words):
            return Judgement(False, "missing")
        s, e = _gold_span(toks, set(gold_content))
        before = [n for raw, n in toks[:s] if raw[0].isalnum() and n not in _ARTICLES][-2:]
        if any(w in _NEGATIONS or w.endswith("n't") for w in before):  # "not Paris", "isn't the Paris"
            return Judgement(False, "contradiction")
        allowed = set(_words(question)) | set(gold_words)
        if _coordinated_name(toks, s, e, allowed):
            return Judgement(False, "contradiction")
        if any(w.isdigit() for w in gold_content) and {w for w in pred_words if w.isdigit()} - allowed:
            return Judgement(False, "contradiction")  # a numeric answer with another number in it
        return Judgement(True, "contained")

    def grade_many(self, items: Sequence[tuple[str, str, str]], progress: bool | None = False) -> list[Judgement]:
        """:meth:`grade` for each ``(question, gold, predicted)``, in order."""
        return [self.grade(q, g, p) for q, g, p in items]

    def config(self) -> dict:
        """What a report records about this judge."""
        return {"judge": "rule"}


# --------------------------------------------------------------------------------------- openai


def parse_grade(reply: str) -> bool | None:
    """The paper's A/B parsing: True for "A", False for "B", None when neither can be read."""
    text = (reply or "").strip().strip("\"'`*. ")
    if text[:1] in ("A", "B") and (len(text) == 1 or not text[1].isalpha()):
        return text[0] == "A"
    m = re.search(r"\b([AB])\b", reply or "")
    if m:
        return m.group(1) == "A"
    up = (reply or "").upper()
    if "INCORRECT" in up:
        return False
    if "CORRECT" in up:
        return True
    return None


class OpenAIJudge:
    """LLM-as-a-judge over an OpenAI-compatible chat-completions endpoint (urllib, no SDK needed)."""

    name = "openai"

    def __init__(
        self,
        base_url: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 60.0,
        workers: int = 8,
        retries: int = 4,
    ):
        env = os.environ
        self.base_url = (
            base_url or env.get("CRISPEDIT_JUDGE_BASE_URL") or env.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        ).rstrip("/")
        self.model = model or env.get("CRISPEDIT_JUDGE_MODEL") or "gpt-4o-mini"
        self._key = api_key or env.get("CRISPEDIT_JUDGE_API_KEY") or env.get("OPENAI_API_KEY")
        if not self._key:
            raise CrispEditError("--judge openai needs an API key in CRISPEDIT_JUDGE_API_KEY or OPENAI_API_KEY")
        self.timeout, self.workers, self.retries = timeout, workers, retries

    def __repr__(self) -> str:  # never show the key
        return f"OpenAIJudge(base_url={self.base_url!r}, model={self.model!r})"

    def _ask(self, prompt: str) -> str:
        body = json.dumps(
            {"model": self.model, "temperature": 0, "max_tokens": 4, "messages": [{"role": "user", "content": prompt}]}
        ).encode()
        req = urllib.request.Request(
            f"{self.base_url}/chat/completions",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self._key}"},
        )
        delay = 1.0
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    data = json.loads(resp.read().decode())
                return str(data["choices"][0]["message"]["content"] or "")
            except urllib.error.HTTPError as exc:
                if exc.code in (429, 500, 502, 503, 504) and attempt < self.retries:
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise CrispEditError(f"judge endpoint {self.base_url} answered HTTP {exc.code}") from None
            except (urllib.error.URLError, TimeoutError, OSError) as exc:
                if attempt < self.retries:
                    time.sleep(delay)
                    delay *= 2
                    continue
                reason = getattr(exc, "reason", exc)
                raise CrispEditError(f"judge endpoint {self.base_url} unreachable: {reason}") from None
            except (KeyError, IndexError, ValueError):
                raise CrispEditError(f"judge endpoint {self.base_url} sent a malformed reply") from None
        raise AssertionError("unreachable")

    def grade(self, question: str, gold: str, predicted: str) -> Judgement:
        """Ask the endpoint with the paper's grader prompt; ``reason`` is the start of its reply."""
        reply = self._ask(GRADER_PROMPT.format(question=question, target=gold, predicted_answer=predicted))
        return Judgement(bool(parse_grade(reply)), reply.strip()[:40])

    def grade_many(self, items: Sequence[tuple[str, str, str]], progress: bool | None = False) -> list[Judgement]:
        """:meth:`grade` for each ``(question, gold, predicted)`` on ``workers`` threads, results in order."""
        from tqdm.auto import tqdm

        with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            it = pool.map(lambda x: self.grade(*x), items)
            return list(tqdm(it, total=len(items), desc="judge", disable=(None if progress is None else not progress)))

    def config(self) -> dict:
        """What a report records about this judge (never the API key)."""
        return {"judge": "openai", "base_url": self.base_url, "model": self.model}


def make_judge(name: str):
    """The judge called ``name`` (``rule`` or ``openai``); one-line error otherwise."""
    if name == "rule":
        return RuleJudge()
    if name == "openai":
        return OpenAIJudge()
    raise CrispEditError(f"unknown judge {name!r} (use one of: {', '.join(JUDGES)})")
