"""A draft head over the target's own hidden states (EAGLE-style): its data, training and measurement (issue 31).

`make head` runs collect --stored, train (HEAD_FROM: --init-file) and export --vocab-rows: the head `--draft head` loads
(verispec.drafters.draft_head). The target's answers are kept as token ids in data/head-answers (answer_store.py), so
a set written on one machine is only teacher-forced on the next.

The question: can a drafter that costs <= 0.15 of a target forward be accepted often enough to pay on these
CPUs? Candidates measured here, both over the target's own last-layer features so that none needs a model of
its own:

- **head**: one decoder layer (EAGLE-1's shape) that reads the target's normalized last hidden state f_t and
  the embedding of the token the target chose next, x_{t+1}, and predicts f_{t+1}; the target's own output
  head (restricted to the tokens the training data shows, q zero elsewhere: verification stays exact) turns
  it into a draft token. Drafting on, it feeds its own predicted feature and its draft token back in.
- **layer skip** (untrained): the target's first L layers, then its final norm and output head.

Data recipe (all offline, from what the machine has):
- text: the standard library's sources and pydoc topics (verispec.drafters.draft_vocab.corpus_files), in a
  shuffled fixed order, in 256-token windows;
- the target's own greedy answers (plain decoding, 128 tokens) to prompts that are not measured: HumanEval
  and code-edit problems 16..79, and TRAIN_CHAT below (questions written for this study, none of chat.jsonl's);
  with --more also to HumanEval and code-edit 80.., and to MORE_CHAT_* (120 more questions), and all of these
  answered once more sampled (temperature 0.7, top-p 0.95); with --self-chat N also to N questions the target
  wrote itself, twenty at a time about each of SELF_CHAT_TOPICS (the measured chat prompts left out), with
  --self-chat-more N to N more about SELF_CHAT_MORE_TOPICS (none of the first round's); with
  --stdlib-code N to N standard-library functions cut after their docstring (HumanEval's form) and N whole ones
  with an edit to make (code-edit's form), --stdlib-skip M: the next N after the first M (a further batch); with
  --sampled-again SET... each kept SET's prompts answered once more sampled (SET-sampled); with
  --stored to every set kept in data/head-answers;
- measured: the first 16 prompts of humaneval, chat and code-edit, as bench-serve uses them, answered by the
  target greedily; each evaluated position sees the target's true features before it, as a drafter would.

Everything the target computes runs in its served format (load_model quantize="auto"). The head trains in
float32 with bfloat16 autocast, on windows padded to the longest of their batch (padding masked out). Commands
(each step caches its output under --work):

    python benchmarks/draft_head/study.py collect --work /tmp/draft-head
    python benchmarks/draft_head/study.py train --work /tmp/draft-head --minutes 20  # --init: go on from head.pt
    python benchmarks/draft_head/study.py train --work /tmp/draft-head --init-file HEAD_FILE  # go on from a head file
    python benchmarks/draft_head/study.py evaluate --work /tmp/draft-head --out benchmarks/results/xeon/draft-head
    python benchmarks/draft_head/study.py export --work /tmp/draft-head   # to where --draft head finds it
    python benchmarks/draft_head/study.py vocab --work /tmp/draft-head --out /tmp/vocab.json  # output rows, priced
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import answer_store  # noqa: E402  (benchmarks/draft_head is not a package)
from verispec.drafters.draft_head import (
    HEAD_WEIGHTS, SHIPPED_HEADS, DraftHead, built_head_path, loaded_tensors, rms, save_head, ship_head, stored_tensors,
)

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"  # the default draft model, compared at its first position
WINDOW = 256  # tokens per teacher-forced window
ANSWER_TOKENS = 128
MEASURED = 16  # the first prompts of each workload, as bench-serve --limit 16 uses them
TRAIN_PROMPTS = slice(16, 80)
TRAIN_CHAT = [
    "My laptop battery drains in two hours even when idle. What can I do about it?",
    "How do I ask my manager for a raise without sounding demanding?",
    "What is the difference between a Roth IRA and a traditional IRA?",
    "Can you suggest a simple weekly meal plan for someone who is vegetarian?",
    "My package tracking has said 'in transit' for nine days. Should I contact the seller?",
    "Explain how a heat pump works to someone without an engineering background.",
    "I want to start running. How should I plan my first month?",
    "What should I pack for a three-day business trip in winter?",
    "How do vaccines train the immune system?",
    "My sourdough bread comes out dense. What am I doing wrong?",
    "Write a polite email declining a meeting invitation because of a scheduling conflict.",
    "What are good questions to ask at the end of a job interview?",
    "How can I keep my houseplants alive while I am away for two weeks?",
    "Explain the difference between weather and climate.",
    "My phone says the storage is full. What can I safely delete?",
    "How does compound interest work? Give a small example.",
    "I was charged twice for the same order. How do I get one charge refunded?",
    "What is a good way to learn a new language as a busy adult?",
    "Why do cats knead blankets?",
    "Give me tips for a first-time visit to Tokyo.",
    "How do I change a flat tire safely?",
    "Explain what an API is using a restaurant analogy.",
    "What are the pros and cons of renting versus buying a home?",
    "How do noise-cancelling headphones work?",
    "My Wi-Fi keeps disconnecting in one room. How can I fix it?",
    "Summarize the causes of the French Revolution in a few paragraphs.",
    "How should I prepare for a long-haul flight to avoid jet lag?",
    "What is the best way to clean a cast iron pan?",
    "How can a small team run better meetings?",
    "Explain photosynthesis to a ten-year-old.",
    "I forgot the password of my router's admin page. What are my options?",
    "Which documents do I need to renew a passport, typically?",
]


# More chat for `collect --more`: questions of the kinds chat.jsonl asks (support, how-to, explain, write), made from
# these parts in a fixed order; none of them is one of the measured prompts.
MORE_CHAT_FORMS = [
    "How do I {}?", "Can you explain {} in simple terms?", "What are the pros and cons of {}?",
    "Give me a step-by-step plan for {}.", "What should I know before {}?",
    "What are common mistakes people make when {}?",
    "Write a short, friendly message to a colleague about {}.", "I need help with {}. Where do I start?",
]
MORE_CHAT_TOPICS = [
    "resetting a forgotten email password", "returning a damaged item bought online", "setting up two-factor "
    "authentication", "budgeting for a family of four", "preparing for a technical interview", "moving to a new city",
    "choosing a laptop for programming", "backing up photos from my phone", "training a puppy to walk on a leash",
    "writing a cover letter", "speeding up a slow home computer", "planning a birthday party for a child",
    "negotiating the price of a used car", "learning to play the guitar", "cancelling a gym membership",
    "asking for feedback on my work", "reducing my electricity bill", "organizing a small home office",
    "starting a vegetable garden on a balcony", "disputing a charge on my credit card", "improving my sleep",
    "migrating a website to a new host", "choosing between two job offers", "teaching a teenager to drive",
    "dealing with a noisy neighbour", "setting up a home Wi-Fi network", "running a remote team meeting",
    "writing unit tests for a Python project", "using git branches", "deploying a web app with Docker",
    "securing a small business network", "reading a nutrition label", "renewing a driver's license",
    "filing an insurance claim after a minor car accident", "making a monthly meal plan", "keeping a journal",
    "studying for an exam in two weeks", "getting started with SQL databases", "onboarding a new employee",
    "writing a polite complaint to a landlord",
]
MORE_CODE_TASKS = [
    "reverses the words of a sentence", "checks whether a string is a palindrome", "merges two sorted lists",
    "counts word frequencies in a text file", "parses a CSV file into a list of dictionaries",
    "finds the longest common prefix of a list of strings", "flattens a nested list", "validates an email address",
    "computes the n-th Fibonacci number with memoization", "groups a list of records by a key",
    "retries a function call with exponential backoff", "reads a JSON config file with defaults",
    "implements a simple LRU cache", "converts a Roman numeral to an integer",
    "removes duplicates while keeping order",
    "finds all prime numbers below n", "formats a number of bytes as a human-readable string",
    "computes the moving average of a list", "checks whether two strings are anagrams",
    "rotates a matrix by 90 degrees",
]


# --self-chat: questions the target writes itself, by topic (none of chat.jsonl's measured prompts), then answers.
SELF_CHAT_TOPICS = [
    "returns, refunds and late deliveries from online shops", "account logins, passwords and subscriptions",
    "choosing a laptop, phone or headphones", "comparing household appliances", "how the internet and browsers work",
    "git and version control", "databases and SQL", "Python programming", "Docker and deploying software",
    "caching and the performance of web services", "computer security and privacy", "regular expressions",
    "the Linux command line", "JavaScript and web pages", "REST APIs and HTTP", "cloud computing and its costs",
    "data analysis with pandas", "machine learning basics", "personal finance and saving money", "travel planning",
    "cooking and recipes", "sleep, health and exercise", "home repairs", "gardening", "caring for pets",
    "job interviews and careers", "writing emails at work", "managing a team", "learning a language",
    "studying for exams", "science explained simply", "history", "gift ideas", "car maintenance", "parenting",
    "productivity apps", "smart home devices", "software testing", "algorithms and data structures",
    "operating systems and computer hardware",
]
# --self-chat-more: a second round of topics, other than SELF_CHAT_TOPICS' (support chat's kinds first)
SELF_CHAT_MORE_TOPICS = [
    "airline bookings, delays and lost luggage", "bank accounts, cards and fraud alerts",
    "mobile phone plans and roaming", "printer and scanner problems", "email clients and spam",
    "video calls and conferencing apps", "spreadsheets and Excel formulas", "word processors and formatting documents",
    "privacy settings on social media", "buying a used car", "renting an apartment and tenants' rights",
    "insurance policies and claims", "taxes for freelancers", "starting a small business",
    "marketing a small online shop", "customer service and handling complaints", "writing a resume",
    "public speaking", "time management", "stress and mental health", "nutrition and meal preparation",
    "running and fitness training", "photography", "practising a musical instrument", "video games and consoles",
    "streaming services and setting up a TV", "home routers and networking", "backups and cloud storage",
    "password managers", "shell scripting and automation", "C and C++ programming", "Java and the JVM",
    "Rust programming", "TypeScript and frontend frameworks", "Kubernetes in production",
    "continuous integration and code review", "debugging and reading error messages", "designing and documenting APIs",
    "mathematics homework", "physics and chemistry explained simply",
]
SAMPLED_TEMPERATURE = 0.7  # the -sampled sets' answers (top-p 0.95)
SELF_CHAT_ASK = ("Write 20 different questions or requests that users often send to an AI assistant about {}. Vary "
                 "their length and style. Write one per line, with no numbering and nothing else.")
SELF_CHAT_LIST_TOKENS = 512


def self_chat_questions(loaded, work: Path, wanted: int, topics: list[str] = SELF_CHAT_TOPICS,
                        name: str = "self-chat-questions", left_out: frozenset[str] = frozenset()) -> list[str]:
    """Up to `wanted` questions the target wrote about `topics` (greedy, one list a topic), kept in
    work/NAME.json; the measured chat prompts, `left_out` (lower case) and duplicates are left out."""
    from verispec.bench.workloads import load_workload

    path = work / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())[:wanted]
    asks = [{"messages": [{"role": "user", "content": SELF_CHAT_ASK.format(topic)}]} for topic in topics]
    lists = answers(loaded, encoded_prompts(loaded, asks), max_tokens=SELF_CHAT_LIST_TOKENS)
    measured = {item["messages"][-1]["content"].strip().lower() for item in load_workload("chat")} | left_out
    questions, seen = [], set()
    for text in (loaded.tokenizer.decode(ids, skip_special_tokens=True) for ids in lists):
        for line in text.splitlines():
            question = re.sub(r"^\s*(?:[-*\u2022]|\d+[.)])\s*", "", line).strip().strip('"')
            key = question.lower()
            if 15 <= len(question) <= 300 and question[-1] in "?." and key not in seen and key not in measured:
                seen.add(key)
                questions.append(question)
    random.Random(0).shuffle(questions)  # topics mixed, so any first `wanted` spans them
    path.write_text(json.dumps(questions, indent=1) + "\n")
    log(f"self-chat: {len(questions)} questions from {len(asks)} topics")
    return questions[:wanted]


def more_chat_prompts() -> list[str]:
    """Every topic in two of the forms (by a fixed draw), and every code task asked two ways: 120 questions."""
    draw = random.Random(1)
    questions = [form.format(topic) for topic in MORE_CHAT_TOPICS for form in draw.sample(MORE_CHAT_FORMS, 2)]
    for task in MORE_CODE_TASKS:
        questions.append(f"Write a Python function that {task}.")
        questions.append(f"Explain how to write a Python function that {task}, with an example.")
    return questions


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the target's features


class FeatureTap:
    """Teacher-forces token windows through the target and keeps, per position, its last hidden state (before the
    final norm), its next-token argmax, and the hidden state after chosen early layers (layer skip): the states the
    target's forward hands on with Transformer.feature_layers."""

    def __init__(self, loaded, early_layers: tuple[int, ...] = ()) -> None:
        self.loaded, self.model = loaded, loaded.model
        self.early_layers = tuple(sorted(early_layers))

    def run(self, ids: list[int]) -> dict[str, torch.Tensor]:
        """One sequence teacher-forced in WINDOW-token forwards: features (T, C) bf16, argmax (T,), early layers'
        hidden states (T, C) each."""
        model = self.model
        layers = (*self.early_layers, model.config.num_layers)  # the last: the state the final norm reads
        cache = model.new_cache(1, len(ids) + 1)
        parts: dict[str, list[torch.Tensor]] = {"features": [], "argmax": []}
        model.feature_layers = layers
        try:
            for start in range(0, len(ids), WINDOW):
                chunk = ids[start : start + WINDOW]
                hidden: list[torch.Tensor] = []
                logits = model.forward(torch.tensor([chunk]), cache, hidden_out=hidden)  # (1, T, V)
                cache.commit(len(chunk))
                parts["argmax"].append(logits[0].argmax(-1))
                for layer, state in zip(layers, hidden[0][0].chunk(len(layers), -1)):  # (T, C) each
                    name = "features" if layer == layers[-1] else f"early{layer}"
                    parts.setdefault(name, []).append(state.to(torch.bfloat16))
        finally:
            model.feature_layers = ()
        return {"ids": torch.tensor(ids)} | {name: torch.cat(p) for name, p in parts.items()}


def answers(loaded, prompts: list[list[int]], temperature: float = 0.0,
            max_tokens: int = ANSWER_TOKENS) -> list[list[int]]:
    """The target's answers (up to max_tokens; greedy, or sampled at `temperature`) to the encoded prompts: plain
    decoding, 16 rows at a time."""
    from verispec.engine import GenerationConfig
    from verispec.sampling import SamplingParams
    from verispec.serving.scheduler import Scheduler, SchedulerLimits

    scheduler = Scheduler(loaded, None, "none", k=0, limits=SchedulerLimits(16, 1024, 2048))
    sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0)
    handles = [
        scheduler.submit(ids, GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, seed=i))
        for i, ids in enumerate(prompts)
    ]
    while scheduler.run_once():
        pass
    outs = []
    for handle in handles:
        tokens = []
        for event in handle.iter_events():
            tokens.extend(event.token_ids or [])
        outs.append(tokens)
    return outs


def encoded_prompts(loaded, items: list[dict]) -> list[list[int]]:
    from verispec.bench.workloads import render_prompt

    return [loaded.encode(render_prompt(loaded.tokenizer, item)) for item in items]


def encoded_questions(loaded, questions: list[str]) -> list[list[int]]:
    """Chat questions as the target reads them: each one user message, in its chat template."""
    return encoded_prompts(loaded, [{"messages": [{"role": "user", "content": q}]} for q in questions])


def corpus_windows(tokenizer, tokens_wanted: int, seed: int = 0) -> list[list[int]]:
    from verispec.drafters.draft_vocab import corpus_files

    files = corpus_files()
    random.Random(seed).shuffle(files)
    windows, total = [], 0
    for path in files:
        ids = tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
        for start in range(0, len(ids) - WINDOW // 2, WINDOW):  # at most two windows a file: more files
            windows.append(ids[start : start + WINDOW])
            total += len(windows[-1])
            if start >= WINDOW:
                break
        if total >= tokens_wanted:
            break
    return windows


def answers_about(loaded, temperature: float) -> dict:
    """What wrote a set of answers (the target, its format, the machine kind, the sampling), kept with it
    (answer_store.py)."""
    from verispec.bench.machine import machine_kind

    return {"target": TARGET, "format": loaded.format.label, "machine": machine_kind(), "temperature": temperature,
            "top_p": 0.95 if temperature else 1.0, "max_tokens": ANSWER_TOKENS, "kept": time.strftime("%Y-%m-%d")}


def cmd_collect(args) -> None:
    from verispec.bench.workloads import load_workload
    from verispec.models.loading import load_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    loaded = load_model(TARGET, quantize="auto")
    log(f"target {TARGET} as {loaded.format.label}")
    tap = FeatureTap(loaded, tuple(args.early_layers))
    sets = {}
    for name in ("humaneval", "chat", "code-edit"):
        items = load_workload(name)
        sets[f"eval-{name}"] = encoded_prompts(loaded, items[:MEASURED])
        if name != "chat":
            sets[f"train-{name}"] = encoded_prompts(loaded, items[TRAIN_PROMPTS])
    sets["train-chat"] = encoded_questions(loaded, TRAIN_CHAT)
    temperatures = {}
    if args.more:  # the rest of HumanEval and code-edit, more chat, and every training prompt answered sampled too
        for name in ("humaneval", "code-edit"):
            sets[f"train-{name}-more"] = encoded_prompts(loaded, load_workload(name)[TRAIN_PROMPTS.stop :])
        sets["train-chat-more"] = encoded_questions(loaded, TRAIN_CHAT + more_chat_prompts())[len(TRAIN_CHAT) :]
        for name in [n for n in sets if n.startswith("train-")]:
            sets[f"{name}-sampled"], temperatures[f"{name}-sampled"] = sets[name], SAMPLED_TEMPERATURE
    store = Path(args.store) if args.store else None

    def written(name: str) -> bool:  # collected here, or its answers kept: no questions to write for it
        return (work / f"{name}.pt").exists() or bool(store and (store / f"{name}.npz").exists())

    if args.self_chat:  # questions the target writes, answered greedily
        sets["train-chat-self"] = None if written("train-chat-self") else encoded_questions(
            loaded, self_chat_questions(loaded, work, args.self_chat))
    if args.self_chat_more:  # a second round of topics; none of the first round's questions
        sets["train-chat-self-more"] = None
        if not written("train-chat-self-more"):
            first = {q.lower() for q in self_chat_questions(loaded, work, 10**6)}
            sets["train-chat-self-more"] = encoded_questions(loaded, self_chat_questions(
                loaded, work, args.self_chat_more, SELF_CHAT_MORE_TOPICS, "self-chat-more-questions", frozenset(first)))
    if args.stdlib_code:  # standard-library functions to complete and to edit, answered greedily
        completions, edits = answer_store.stdlib_code_items(args.stdlib_code, args.stdlib_skip)
        batch = f"-from{args.stdlib_skip}" if args.stdlib_skip else ""
        sets[f"train-stdlib-complete{batch}"] = encoded_prompts(loaded, completions)
        sets[f"train-stdlib-edit{batch}"] = encoded_prompts(loaded, edits)
    for name in args.sampled_again:  # a kept set's prompts answered once more, sampled: new text, the same questions
        source = store / f"{name}.npz" if store else None
        if not (name.startswith("train-") and source and source.exists()):
            raise SystemExit(f"--sampled-again {name}: not a kept training set; kept in {store}: "
                             f"{', '.join(answer_store.stored_sets(store)) if store else 'none'}")
        again = f"{name}-sampled"
        temperatures[again] = SAMPLED_TEMPERATURE
        sets[again] = None if written(again) else [ids[:start] for ids, start in answer_store.load_answers(source)[0]]
    if store and args.stored:  # every kept set, whether or not these options name it
        sets |= {name: None for name in answer_store.stored_sets(store) if name not in sets}
    for name, prompts in sets.items():
        path = work / f"{name}.pt"
        if path.exists():
            continue
        kept = store / f"{name}.npz" if store and name.startswith("train-") else None
        started = time.perf_counter()
        if kept and kept.exists():  # written on some machine before: only teacher-forced here
            kept_rows, about = answer_store.load_answers(kept)
            prompts, outs = [ids[:start] for ids, start in kept_rows], [ids[start:] for ids, start in kept_rows]
            log(f"{name}: {len(prompts)} kept answers ({about.get('machine')}, {about.get('format')}) from {kept}")
        elif prompts is None:
            continue
        else:
            temperature = temperatures.get(name, 0.0)
            outs = answers(loaded, prompts, temperature)
            log(f"{name}: {len(prompts)} answers, {sum(map(len, outs))} tokens in "
                f"{time.perf_counter() - started:.0f} s")
            if kept:
                answer_store.save_answers(kept, [(p + o, len(p)) for p, o in zip(prompts, outs)],
                                          answers_about(loaded, temperature))
        started = time.perf_counter()
        rows = [dict(tap.run(p + o), answer_start=len(p)) for p, o in zip(prompts, outs)]
        tokens = sum(len(r["ids"]) for r in rows)
        log(f"{name}: features of {tokens} tokens in {time.perf_counter() - started:.0f} s")
        torch.save(rows, path)
    path = work / ("train-text.pt" if args.text_seed == 0 else f"train-text-{args.text_seed}.pt")
    if not path.exists():
        started = time.perf_counter()
        windows = corpus_windows(loaded.tokenizer, args.text_tokens, args.text_seed)
        rows = []
        for i, window in enumerate(windows):
            rows.append(dict(tap.run(window), answer_start=0))
            if i % 50 == 0:
                log(f"text: {i}/{len(windows)} windows, {time.perf_counter() - started:.0f} s")
        log(f"text: {sum(len(w) for w in windows)} tokens in {time.perf_counter() - started:.0f} s")
        torch.save(rows, path)


def cmd_keep(args) -> None:
    """Every answer set in --work (train-*, not the text windows, which any machine cuts again) kept in --store as
    token ids, unless kept there already: what a set collected before the store existed needs."""
    from verispec.models.loading import load_model

    work, store = Path(args.work), Path(args.store)
    names = [name for name in training_sets(work) if not name.startswith("train-text")]
    missing = [name for name in names if not (store / f"{name}.npz").exists()]
    if not missing:
        log(f"every answer set in {work} is kept in {store}")
        return
    loaded = load_model(TARGET, quantize="auto")  # its format: what wrote them, when they were collected here
    for name in missing:
        rows = [(row["ids"].tolist(), int(row["answer_start"])) for row in torch.load(work / f"{name}.pt", mmap=True)]
        temperature = SAMPLED_TEMPERATURE if name.endswith("-sampled") else 0.0
        answer_store.save_answers(store / f"{name}.npz", rows, answers_about(loaded, temperature))
        log(f"{name}: {len(rows)} answers kept in {store}")


# ---------------------------------------------------------------- the head


def load_rows(work: Path, names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        for row in torch.load(work / f"{name}.pt"):  # the early layers' states (layer skip) are not the head's
            rows.append({key: value for key, value in row.items() if not key.startswith("early")})
    return rows


def training_pairs(rows: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Windows of WINDOW positions t of each row: inputs (normalized f_t, x_{t+1}), targets (normalized f_{t+1},
    the target's argmax at t+1: the token it chooses after x_{t+1})."""
    pairs = []
    for row in rows:
        f = rms(row["features"].float())
        ids, argmax = row["ids"], row["argmax"]
        for start in range(0, len(ids) - 1, WINDOW):
            stop = min(start + WINDOW, len(ids) - 1)
            if stop - start < 8:
                continue
            # input at t: (f_t, x_{t+1}); output: f_{t+1}, whose head gives the target's choice after x_{t+1}
            after = slice(start + 1, stop + 1)
            pairs.append((f[start:stop], ids[after], f[after], argmax[after]))
    return pairs


def padded_batch(batch: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Windows of a batch padded on the right to the longest (a padded position is after every real one, so the
    causal layer keeps them apart): features, next ids, next features, labels (-1 where padded)."""
    length = max(len(b[1]) for b in batch)

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        missing = length - len(t)
        return F.pad(t, (0, 0, 0, missing) if t.dim() == 2 else (0, missing), value=value)

    return tuple(torch.stack([pad(b[j], -1 if j == 3 else 0) for b in batch]) for j in range(4))


def build_head(loaded, vocab: torch.Tensor, intermediate: int) -> DraftHead:
    model = loaded.model
    embed = model.embed.float()
    head = model.lm_head.weight.float()  # (V, C): the embedding where the head is tied; the model is dense here
    config = model.config
    return DraftHead(embed, model.final_norm.float(), head, vocab, config.num_heads, intermediate, config.rope_theta)


def trained_head(work: Path, loaded, strict: bool = False) -> tuple[DraftHead, dict]:
    """The head `train` saved in work/head.pt, over the dense target `loaded`, and what was saved with it."""
    saved = torch.load(work / "head.pt")
    head = build_head(loaded, saved["vocab"], saved["intermediate"])
    head.load_state_dict(saved["state"], strict=strict)
    return head, saved


def vocab_ranking(rows: list[dict], vocab_size: int) -> torch.Tensor:
    """Every target id (vocab_size,), the ones the target chose most often in `rows` first (ties: lower id first)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        counts += torch.bincount(row["argmax"], minlength=vocab_size)[:vocab_size]
    return counts.argsort(descending=True, stable=True)


def training_sets(work: Path) -> list[str]:
    """The names of every training set collected in work (train-*: --text-seed, --more, --self-chat), or an exit
    that says how to collect them."""
    names = sorted(path.stem for path in work.glob("train-*.pt"))
    if not names:
        raise SystemExit(f"no train-* rows in {work}: run `study.py collect --work {work}` first")
    return names


def training_ranking(work: Path, vocab_size: int) -> tuple[torch.Tensor, dict]:
    """vocab_ranking over work's train-* rows (the ids the target chose most first), and a note of what ranked them:
    `ranking[:size].sort().values` is an output vocabulary for a head file."""
    names = training_sets(work)
    counted = [{"argmax": row["argmax"]} for name in names for row in torch.load(work / f"{name}.pt", mmap=True)]
    return vocab_ranking(counted, vocab_size), {"ranked_by": names}


def head_vocab(rows: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The head's vocabulary: the `size` ids the target chose most often in `rows`, sorted by id."""
    return vocab_ranking(rows, vocab_size)[:size].sort().values


def head_rows(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) each target id's row of the head's output over `vocab`; -100 (cross-entropy's ignored class)
    for an id the head has no row for."""
    index = torch.full((vocab_size,), -100, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    return index


def file_head(loaded, path: Path, vocab: torch.Tensor | None = None) -> DraftHead:
    """A last-layer head file (int8 matrices back in float32) as a DraftHead over the dense target `loaded`, over
    its own vocabulary or `vocab`: the head predicts a feature, so any set of the target's output rows drafts."""
    from safetensors.torch import load_file

    tensors = loaded_tensors(load_file(str(path)))
    if "fuse" in tensors:
        raise SystemExit(f"{path} is a fused head: read it with fused.py")
    head = build_head(loaded, tensors["vocab"].long() if vocab is None else vocab, tensors["gate_up"].shape[0] // 2)
    with torch.no_grad():
        for name, parameter in head.trained_tensors().items():
            if name != "vocab":
                parameter.copy_(tensors[name])
    return head.eval()


def scheduled_lr(base: float, step: int, fraction: float) -> float:
    """The training's learning rate at `step`, `fraction` of the time budget spent: warm up over 30 steps, then a
    cosine to a tenth of `base` (study, fused and block train by it)."""
    warm = min(1.0, (step + 1) / 30)
    return base * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * fraction)))


def head_file_training(path: Path) -> dict:
    """What a head file's metadata says of its training, for the record of a head trained on from it: a study.py
    head's runs and data; a fused.py head's whole record (its run, and the head that run started from)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as opened:
        about = json.loads((opened.metadata() or {}).get("about", "{}"))
    if about.get("recipe") == "benchmarks/draft_head/fused.py":  # `make head`'s last part, the head shipped now
        return about
    return {key: about[key] for key in ("runs", "data") if key in about}


def cmd_train(args) -> None:
    from verispec.models.loading import load_model

    work = Path(args.work)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = load_model(TARGET)  # dense weights: the embedding, norm and head in the compute dtype
    names = training_sets(work)
    rows = load_rows(work, names)
    if args.init:  # go on training a head (its vocabulary and width kept), with whatever data is here now
        head, saved = trained_head(work, loaded)
        vocab, args.intermediate = saved["vocab"], saved["intermediate"]
        log(f"going on from head.pt ({saved['minutes']} minutes, {saved['positions']} positions)")
        earlier_runs = saved.get("runs", [{k: saved[k] for k in ("minutes", "positions", "train_positions")}])
    elif args.init_file:  # go on from a head file (the shipped one): its weights, vocabulary and width
        head = file_head(loaded, Path(args.init_file)).train()
        vocab, args.intermediate = head.vocab, head.down.weight.shape[1]
        log(f"going on from {args.init_file}")
        earlier_runs = [{"from": Path(args.init_file).name, **head_file_training(Path(args.init_file))}]
    else:
        vocab = head_vocab(rows, args.vocab, loaded.model.vocab_size)
        head = build_head(loaded, vocab, args.intermediate)
        earlier_runs = []
    index = head_rows(vocab, loaded.model.vocab_size)
    pairs = training_pairs(rows)
    tokens = sum(len(p[1]) for p in pairs)
    covered = sum(int((index[p[3]] >= 0).sum()) for p in pairs) / tokens
    log(f"{len(pairs)} windows, {tokens} positions; head of {len(vocab)} tokens covers {covered:.1%} of the labels")
    params = [p for p in head.parameters() if p.requires_grad]
    log(f"{sum(p.numel() for p in params) / 1e6:.1f}M trained parameters")
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    deadline = time.perf_counter() + args.minutes * 60
    started, step, seen = time.perf_counter(), 0, 0
    history = []
    order = list(range(len(pairs)))
    epoch = 0
    while time.perf_counter() < deadline:
        random.Random(epoch).shuffle(order)
        for start in range(0, len(order), args.batch):
            if time.perf_counter() >= deadline:
                break
            f, nxt, f_next, labels = padded_batch([pairs[i] for i in order[start : start + args.batch]])
            real = labels >= 0  # (B, T): not padding
            elapsed = time.perf_counter() - started
            fraction = min(elapsed / (args.minutes * 60), 1.0)
            for group in optimizer.param_groups:
                group["lr"] = scheduled_lr(args.lr, step, fraction)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                predicted = head(f, nxt)
                logits = head.logits(predicted)
            per_position = F.smooth_l1_loss(predicted.float(), f_next, beta=0.1, reduction="none").mean(-1)  # (B, T)
            regression = (per_position * real).sum() / real.sum()
            classes = torch.where(real, index[labels.clamp(min=0)], -100)  # (B, T) the head's row, or ignored
            classification = F.cross_entropy(logits.float().flatten(0, 1), classes.flatten(), ignore_index=-100)
            loss = regression + args.ce_weight * classification
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            seen += labels.numel()
            with torch.no_grad():
                hit = (logits.argmax(-1) == classes)[real].float().mean().item()
            history.append((regression.item(), classification.item(), hit))
            if step % 20 == 0:
                recent = history[-20:]
                regression_mean = statistics.mean(r for r, _, _ in recent)
                ce_mean, hit_mean = statistics.mean(c for _, c, _ in recent), statistics.mean(h for _, _, h in recent)
                log(f"epoch {epoch} step {step}: regression {regression_mean:.3f} ce {ce_mean:.3f} "
                    f"top-1 {hit_mean:.3f} "
                    f"({seen / (time.perf_counter() - started):.0f} positions/s)")
        epoch += 1
    state = {k: v for k, v in head.state_dict().items()}
    run = {"minutes": args.minutes, "positions": seen, "train_positions": tokens}
    torch.save({"state": state, "vocab": vocab, "intermediate": args.intermediate, "steps": step, "positions": seen,
                "epochs": epoch, "minutes": args.minutes, "train_positions": tokens, "label_coverage": covered,
                "runs": earlier_runs + [run]},
               work / "head.pt")
    log(f"saved after {step} steps, {seen} positions, {epoch} epochs")


# ---------------------------------------------------------------- measuring it


RANK_MISS = 1 << 20  # a rank no tree reaches: the token is outside the head's vocabulary, or past the answer


@torch.no_grad()
def unroll(head: DraftHead, row: dict, depth: int, fed: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For every position t of the answer (t = answer_start-1 .. T-2), the head run `depth` steps after the
    target chose x_{t+1}, seeing the target's true features up to t. Each step feeds back its predicted feature
    and a token: its own argmax (fed="draft": a greedy chain) or the answer's true token (fed="truth": the path a
    token tree accepts along). Returns (drafts, ranks), each (N, depth): the head's argmax target ids, and the
    rank of the true token x_{t+2+d} among its guesses at depth d (RANK_MISS outside its vocabulary or answer)."""
    f = rms(row["features"].float())  # (T, C)
    ids = row["ids"]
    T = len(ids)
    first = row["answer_start"] - 1  # the last prompt position: its x_{t+1} is the first answer token
    x = head.layer_input(f[None, : T - 1], ids[None, 1:T])  # (1, T-1, C) inputs at t = 0 .. T-2
    positions = torch.arange(T - 1)
    q, k, v = head.project(x, positions)  # (1, H, T-1, D)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    predicted = head.finish(x, attended)[0]  # (T-1, C): predicted f_{t+1}
    queries = torch.arange(first, T - 1)  # (N,)
    n = len(queries)
    slot = torch.full((max(int(ids.max()), int(head.vocab.max())) + 1,), -1, dtype=torch.long)
    slot[head.vocab] = torch.arange(len(head.vocab))  # target id -> head index, -1 if none
    drafts = torch.zeros(n, depth, dtype=torch.long)
    ranks = torch.full((n, depth), RANK_MISS, dtype=torch.long)
    feature = predicted[queries]  # (N, C)
    token = torch.zeros(n, dtype=torch.long)  # the token fed at the depth before (none before the first)
    chain_k, chain_v = [], []
    mask = positions[None, :] <= queries[:, None]  # (N, T-1): true keys each chain sees
    for d in range(depth):
        if d > 0:
            # input at position t + d: (predicted f_{t+d}, the token fed at depth d-1)
            xi = head.layer_input(feature[:, None], token[:, None])  # (N, 1, C)
            qi, ki, vi = head.project(xi, (queries + d)[:, None])  # (N, H, 1, D) each, at its own position
            chain_k.append(ki)
            chain_v.append(vi)
            keys = torch.cat([k[0].transpose(0, 1).expand(n, -1, -1, -1), torch.cat(chain_k, 2).transpose(1, 2)], 1)
            values = torch.cat([v[0].transpose(0, 1).expand(n, -1, -1, -1), torch.cat(chain_v, 2).transpose(1, 2)], 1)
            # keys: (N, S, H, D) with S = T-1 + d
            visible = torch.cat([mask, torch.ones(n, d, dtype=torch.bool)], 1)  # (N, S)
            scores = torch.einsum("nhd,nshd->nhs", qi[:, :, 0], keys) / head.head_dim**0.5
            scores = scores.masked_fill(~visible[:, None], float("-inf"))
            out = torch.einsum("nhs,nshd->nhd", scores.softmax(-1), values)  # (N, H, D)
            feature = head.finish(xi, out[:, :, None])[:, 0]  # (N, C)
        logits = head.logits(feature)  # (N, V_head)
        drafts[:, d] = head.vocab[logits.argmax(-1)]
        truth_at = queries + 2 + d  # x_{t+2+d}
        inside = truth_at < T
        truth = ids[truth_at.clamp(max=T - 1)]
        index = slot[truth]
        hit = inside & (index >= 0)
        true_logit = logits.gather(1, index.clamp(min=0)[:, None])  # (N, 1)
        rank = (logits > true_logit).sum(-1)
        ranks[:, d] = torch.where(hit, rank, torch.full_like(rank, RANK_MISS))
        token = truth if fed == "truth" else drafts[:, d]
    return drafts, ranks


def chains(head: DraftHead, row: dict, depth: int) -> torch.Tensor:
    """The head's `depth` greedy drafts after each answer position: (N, depth) target ids (see unroll)."""
    return unroll(head, row, depth, fed="draft")[0]


def greedy_steps(truth: torch.Tensor, drafts: torch.Tensor, k: int,
                 tried: list[int] | None = None, right: list[int] | None = None) -> tuple[int, int]:
    """Speculative decoding over the answer with chain k: (target forwards, tokens). truth: (N + 1,) answer ids
    x_{first+1} .., drafts[i]: the chain after truth[i] was chosen. With tried and right (k zeros each), adds per
    position d the steps that reached it and of those the ones right at it: acceptance as the engine's drafter
    table counts it, at the positions where steps start (after a rejection or a whole chain), not at every one."""
    i, forwards, n = 0, 0, len(truth)
    while i < n:
        forwards += 1
        accepted = 0
        while accepted < k and i + 1 + accepted < n:
            if tried is not None:
                tried[accepted] += 1
            if int(drafts[i, accepted]) != int(truth[i + 1 + accepted]):
                break
            if right is not None:
                right[accepted] += 1
            accepted += 1
        i += accepted + 1
    return forwards, n


def position_acceptance(truth: torch.Tensor, drafts: torch.Tensor) -> list[float]:
    """alpha_i: P(draft i right | drafts before it right), over every answer position."""
    n, depth = drafts.shape
    right = torch.zeros(n, depth, dtype=torch.bool)
    for d in range(depth):
        idx = torch.arange(n) + 1 + d
        valid = idx < len(truth)
        right[valid, d] = drafts[valid, d] == truth[idx[valid]]
    alphas, alive = [], torch.ones(n, dtype=torch.bool)
    for d in range(depth):
        valid = alive & (torch.arange(n) + 1 + d < len(truth))
        alphas.append(float(right[valid, d].float().mean()) if valid.any() else float("nan"))
        alive = valid & right[:, d]
    return alphas


class ChainTally:
    """A head's greedy chains over answers, summed: target forwards for chains of k = 1..depth (greedy_steps), the
    acceptance by position over every answer position (position_acceptance, weighted by answer length) and where
    the chain of `depth`'s steps start (the engine's count)."""

    def __init__(self, depth: int) -> None:
        self.depth, self.tokens = depth, 0
        self.forwards = {k: 0 for k in range(1, depth + 1)}
        self.tried, self.right = [0] * depth, [0] * depth
        self.alphas: list[tuple[int, list[float]]] = []  # (answer length, its alpha by position)

    def add(self, truth: torch.Tensor, drafts: torch.Tensor) -> None:
        """One answer: truth (N + 1,) its ids, drafts (N + 1, depth) the chain after each (see greedy_steps)."""
        self.alphas.append((len(truth), position_acceptance(truth, drafts)))
        for k in self.forwards:
            tally = (self.tried, self.right) if k == self.depth else ()
            self.forwards[k] += greedy_steps(truth, drafts, k, *tally)[0]
        self.tokens += len(truth)

    def tokens_per_forward(self) -> dict[int, float]:
        return {k: self.tokens / f for k, f in self.forwards.items()}

    def alpha_by_position(self) -> list[float]:
        weight = sum(n for n, _ in self.alphas)
        return [sum(n * a[d] for n, a in self.alphas if not math.isnan(a[d])) / weight for d in range(self.depth)]

    def alpha_at_steps(self) -> list[float]:
        return [r / t if t else float("nan") for r, t in zip(self.right, self.tried)]


@torch.no_grad()
def tree_steps(ranks: torch.Tensor, tree: set[tuple[int, ...]]) -> tuple[int, int]:
    """Greedy speculative decoding over one answer with a static token tree, a prefix-closed set of rank paths
    (node (0, 2): the head's best guess at depth 1, then its third guess after it): (target forwards, tokens).
    ranks[i]: the true path's ranks after the answer's token i was chosen (unroll, fed="truth"). A step accepts
    the longest prefix of that path the tree holds, then the target's own token."""
    i, forwards, n = 0, 0, len(ranks)
    depth = ranks.shape[1]
    while i < n:
        forwards += 1
        path = tuple(int(r) for r in ranks[i])
        accepted = 0
        while accepted < depth and path[: accepted + 1] in tree:
            accepted += 1
        i += accepted + 1
    return forwards, n


def fit_tree(ranks: list[torch.Tensor], nodes: int) -> set[tuple[int, ...]]:
    """The `nodes` rank paths the true path most often starts with (prefix-closed): the best static tree of that
    size for these answers (EAGLE-2's shape, from counts rather than the head's own probabilities)."""
    counts: dict[tuple[int, ...], int] = {}
    for answer in ranks:
        for path in answer.tolist():
            for d in range(len(path)):
                if path[d] >= RANK_MISS:
                    break
                key = tuple(path[: d + 1])
                counts[key] = counts.get(key, 0) + 1
    tree: set[tuple[int, ...]] = set()
    for key in sorted(counts, key=lambda key: (-counts[key], len(key), key)):
        if len(tree) == nodes:
            break
        if len(key) == 1 or key[:-1] in tree:
            tree.add(key)
    return tree


def tree_ms(tree: set[tuple[int, ...]], head_ms: dict[int, float], target_ms) -> float:
    """A step's forwards: one head step per depth over the nodes that have children there (the root first),
    then one target pass over the tree and the token before it."""
    parents: dict[int, set[tuple[int, ...]]] = {}
    for node in tree:
        parents.setdefault(len(node) - 1, set()).add(node[:-1])

    def head(rows: int) -> float:
        known = sorted(head_ms)
        below = max([r for r in known if r <= rows], default=known[0])
        return head_ms[below] * rows / below if rows > max(known) else head_ms[below]

    return sum(head(len(p)) for p in parents.values()) + target_ms(len(tree) + 1)


def first_position_agreement(model, row: dict) -> tuple[int, int]:
    """How often a model's own argmax after the answer's committed prefix is the target's next answer token:
    (hits, positions), teacher-forced; a draft model's first-position acceptance under greedy decoding."""
    ids = row["ids"].tolist()
    cache = model.new_cache(1, len(ids) + 1)
    best = []
    for start in range(0, len(ids), WINDOW):
        chunk = ids[start : start + WINDOW]
        best.append(model.forward(torch.tensor([chunk]), cache)[0].argmax(-1))
        cache.commit(len(chunk))
    best = torch.cat(best)  # (T,) its choice after each position
    start = row["answer_start"]
    guesses, truth = best[start : len(ids) - 1], row["ids"][start + 1 :]  # after x_P .. x_{T-2}
    return int((guesses == truth).sum()), len(truth)


def verify_forwards_ms(target, depth: int) -> list[float]:
    """[k]: ms of the target's forward over k drafts and the token before them (k = 0..depth), after 256 cached
    tokens, each the median of 15."""
    cache = target.new_cache(1, 256 + 16)
    target.prefill(list(range(1000, 1256)), cache)
    return [time_forward(lambda k=k: target.forward(torch.tensor([[42] * (k + 1)]), cache), 15) * 1e3
            for k in range(depth + 1)]


def predicted_speedups(tokens_per_forward: list[float], verify_ms: list[float], draft_ms: list[float]) -> list[float]:
    """x plain for chains of k = 1..len: tokens per forward x one token's forward / (the verify forward + the step's
    drafting, draft_ms[k - 1]); forwards alone, a ranking rather than a served figure."""
    return [tokens_per_forward[k - 1] * verify_ms[0] / (verify_ms[k] + draft_ms[k - 1])
            for k in range(1, len(tokens_per_forward) + 1)]


def time_forward(function, repeats: int = 30) -> float:
    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def head_cost(head: DraftHead, target_model, context: int = 256, rows: int = 1) -> dict:
    """One draft position's cost in the served formats: the layer's and head's matmuls as verispec Linears in
    the target's weight format, attention over `context` cached keys; and the target's one-token forward.
    `rows` > 1: that many positions at once (a token tree's nodes at one depth)."""
    from verispec.models.linear import Linear

    fmt = target_model.weight_format
    width = head.embed.shape[1]

    def linear(weight):
        lin = Linear(weight.detach().to(target_model.dtype).contiguous())
        lin.quantize(fmt, target_model.activations)
        return lin

    fc, qkv, out = linear(head.fc.weight), linear(head.qkv.weight), linear(head.out.weight)
    gate_up, down, lm = linear(head.gate_up.weight), linear(head.down.weight), linear(head.head)
    keys = torch.randn(1, head.heads, context, head.head_dim, dtype=target_model.dtype)
    x = torch.randn(rows, 2 * width, dtype=target_model.dtype)

    @torch.inference_mode()
    def step():
        h = fc(x)
        q, _ = qkv(h).split([width, 2 * width], -1)
        q = q.view(rows, head.heads, head.head_dim).transpose(0, 1)[None]  # (1, H, rows, D)
        a = F.scaled_dot_product_attention(q, keys, keys)
        h = h + out(a[0].transpose(0, 1).reshape(rows, width))
        g, u = gate_up(h).chunk(2, -1)
        h = h + down(F.silu(g) * u)
        return lm(h).argmax(-1)

    cache = target_model.new_cache(1, context + 8)
    target_model.prefill(list(range(1000, 1000 + context)), cache)

    def target_step():
        target_model.forward(torch.tensor([[42]]), cache)

    head_seconds = time_forward(step)
    target_seconds = time_forward(target_step, 15)
    return {"format": fmt, "head_ms": head_seconds * 1e3, "target_ms": target_seconds * 1e3,
            "fraction": head_seconds / target_seconds}


def cmd_evaluate(args) -> None:
    from verispec.models.loading import load_model

    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    dense = load_model(TARGET)
    head, saved = trained_head(work, dense)
    head.eval()
    if args.weights != "float32":  # as a head file in that storage holds it (export --weights), back in float32
        stored = loaded_tensors(stored_tensors(head, args.weights))
        with torch.no_grad():  # trained_tensors are the module's own parameters, by their names in a head file
            for name, parameter in head.trained_tensors().items():
                if name != "vocab":
                    parameter.copy_(stored[name])
    results = {"training": {k: v for k, v in saved.items() if k not in ("state", "vocab")}, "workloads": {},
               "weights": args.weights}
    results["training"]["head_tokens"] = len(saved["vocab"])
    served = load_model(TARGET, quantize="auto")
    draft = load_model(DRAFT, quantize="w4a8") if args.draft_model else None
    for name in ("humaneval", "chat", "code-edit"):
        rows = torch.load(work / f"eval-{name}.pt")
        depth = args.depth
        tally, skip = ChainTally(depth), {}
        for row in rows:
            truth = row["ids"][row["answer_start"] :]
            tally.add(truth, chains(head, row, depth))
            for key in row:
                if key.startswith("early"):
                    layer = int(key[5:])
                    hidden = row[key][row["answer_start"] - 1 : -1].float()
                    early_logits = (rms(hidden) * dense.model.final_norm.float()) @ dense.model.lm_head.weight.float().T
                    hit = (early_logits.argmax(-1) == truth).float()
                    total, count = skip.get(layer, (0.0, 0))
                    skip[layer] = (total + float(hit.sum()), count + len(truth))
        if draft is not None:
            hits = [first_position_agreement(draft.model, row) for row in rows]
            agreement = sum(h for h, _ in hits) / sum(n for _, n in hits)
            results.setdefault("draft_model_first_position", {})[name] = agreement
        per_position, per_forward = tally.alpha_by_position(), tally.tokens_per_forward()
        results["workloads"][name] = {
            "answer_tokens": tally.tokens,
            "alpha_by_position": per_position,
            f"alpha_by_position_at_steps_k{depth}": tally.alpha_at_steps(),
            "tokens_per_forward": per_forward,
            "layer_skip_first_position": {layer: hits / count for layer, (hits, count) in sorted(skip.items())},
        }
        log(f"{name}: alpha {[round(a, 2) for a in per_position]}, tokens/forward "
            f"{ {k: round(v, 2) for k, v in per_forward.items()} }")
    results["cost"] = head_cost(head, served.model)
    log(f"cost {results['cost']}")
    from verispec.bench.machine import machine_description

    results["machine"] = machine_description()
    results["command"] = " ".join(sys.argv)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


def with_vocab(source: Path, vocab: torch.Tensor, out: Path, note: dict) -> dict:
    """Write the head file `source` over another output vocabulary (target ids, sorted) to `out` (which may be
    `source`): its tensors byte for byte, its metadata with about["vocab"] = note + the size. Returns about, with the
    file's weights."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    stored = {name: tensor.clone() for name, tensor in load_file(str(source)).items()}
    with safe_open(str(source), "pt") as opened:
        metadata = dict(opened.metadata())
    about = json.loads(metadata.get("about", "{}"))
    about["vocab"] = {"size": len(vocab), **note}
    metadata["about"] = json.dumps(about)
    stored["vocab"] = vocab.to(stored["vocab"].dtype)
    save_file({name: tensor.contiguous() for name, tensor in stored.items()}, str(out), metadata=metadata)
    return {**about, "weights": metadata.get("weights", "float32")}


def cmd_vocab(args) -> None:
    """The head file's drafts over output vocabularies of other sizes (the ids the target chose most often in
    --work's train-* rows; its trained weights unchanged): acceptance on the measured answers, a draft position's
    cost and the target's verify forwards timed side by side, and the speed-up over plain each predicts; with
    --write SIZE, the head file over that vocabulary (--ship: as the head verispec ships)."""
    from safetensors.torch import load_file

    from verispec.bench.machine import machine_description
    from verispec.models.loading import load_model

    if not args.write and not args.out:
        raise SystemExit("vocab: --out results.json is needed to measure (or --write SIZE to write a head file)")
    work = Path(args.work)
    torch.set_num_threads(args.threads)
    dense = load_model(TARGET)
    source = Path(args.head)
    ranking, note = training_ranking(work, dense.model.vocab_size)
    if args.write:
        out = SHIPPED_HEADS / f"{TARGET}.safetensors" if args.ship else Path(args.out or built_head_path(TARGET))
        about = with_vocab(source, ranking[: args.write].sort().values, out, {**note, "from": source.name})
        if args.ship:
            ship_head(out, TARGET, about)
        log(f"wrote {out}: {args.write} output rows")
        return
    served = load_model(TARGET, quantize="auto")
    target = served.model
    verify_ms = verify_forwards_ms(target, args.depth)
    results = {"head": str(source), "verify_ms": dict(enumerate(verify_ms)), "sizes": {}}
    own_vocab = load_file(str(source))["vocab"]
    for size in [0, *args.sizes]:  # 0: the file's own vocabulary
        vocab = own_vocab.long() if size == 0 else ranking[:size].sort().values
        head = file_head(dense, source, vocab)
        cost = head_cost(head, target)
        row = {"tokens": len(vocab), "head_ms": cost["head_ms"], "workloads": {}}
        for name in ("humaneval", "chat", "code-edit"):
            tally, inside = ChainTally(args.depth), 0
            for evaluated in torch.load(work / f"eval-{name}.pt"):
                truth = evaluated["ids"][evaluated["answer_start"] :]
                tally.add(truth, chains(head, evaluated, args.depth))
                inside += int(torch.isin(truth, vocab).sum())
            per_forward = list(tally.tokens_per_forward().values())  # chains of 1..depth
            row["workloads"][name] = {
                "covered": inside / tally.tokens,
                f"alpha_at_steps_k{args.depth}": tally.alpha_at_steps(),
                "tokens_per_forward": per_forward,
                "speedup_by_k": predicted_speedups(per_forward, verify_ms,
                                                   [k * cost["head_ms"] for k in range(1, args.depth + 1)]),
            }
        if size == 0:  # DFlash's form on the cost side: k drafts in one forward of k rows, not k forwards of one
            block_ms = [head_cost(head, target, rows=k)["head_ms"] for k in range(1, args.depth + 1)]
            results["block_ms"] = block_ms
            for w in row["workloads"].values():
                w["speedup_by_k_if_one_forward"] = predicted_speedups(w["tokens_per_forward"], verify_ms, block_ms)
        results["sizes"][str(size or "file")] = row
        log(f"{len(vocab)} tokens: {cost['head_ms']:.2f} ms; " + "; ".join(
            f"{name} first {w[f'alpha_at_steps_k{args.depth}'][0]:.3f} best x{max(w['speedup_by_k']):.3f}"
            for name, w in row["workloads"].items()))
    results["machine"] = machine_description()
    results["command"] = " ".join(sys.argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


def cmd_price(args) -> None:
    """Markdown rows: each run's chain k priced from whole forwards timed side by side (tree-potential's run.json:
    the target's forward by new tokens) and the head's measured cost, against a plain step; forwards alone, no
    sampling or Python (an upper bound, as tree-potential's)."""
    target_ms = forward_ms(args.forwards)
    print("| run | workload | alpha by position | k | tokens / forward | x plain |")
    print("|---|---|---|---|---|---|")
    for path in args.runs:
        results = json.loads(Path(path).read_text())
        head_ms = results["cost"]["head_ms"]
        for name, measured in results["workloads"].items():
            speedups = {
                int(k): tokens * target_ms(1) / (int(k) * head_ms + target_ms(int(k) + 1))
                for k, tokens in measured["tokens_per_forward"].items()
            }
            k = max(speedups, key=speedups.get)
            alphas = " / ".join(f"{a:.2f}" for a in measured["alpha_by_position"])
            tokens = measured["tokens_per_forward"][str(k)]
            print(f"| {Path(path).parent.name} | {name} | {alphas} | {k} | {tokens:.2f} | {speedups[k]:.2f}x |")


def forward_ms(path: str):
    """The target's forward cost (ms) by new tokens, from tree-potential's run.json, interpolated as the controller
    interpolates measured costs."""
    from verispec.cost_model import interpolate

    forward = {int(k): v for k, v in json.loads(Path(path).read_text())["forward_ms"]["target"].items()}
    return lambda tokens: interpolate(forward, tokens)


def cmd_trees(args) -> None:
    """Would token trees over the head's guesses pay? Greedy acceptance along each answer's true path, for
    chains and the best static trees of each size (fitted on half the prompts, counted on the other half, both
    ways), priced from whole forwards timed side by side (--forwards) and the head timed at 1..8 rows here."""
    from verispec.models.loading import load_model

    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    dense = load_model(TARGET)
    head, _ = trained_head(work, dense)
    head.eval()
    served = load_model(TARGET, quantize="auto")
    head_ms = {rows: head_cost(head, served.model, rows=rows)["head_ms"] for rows in (1, 2, 4, 8)}
    log(f"head ms by rows {head_ms}")
    target_ms = forward_ms(args.forwards)
    plain = target_ms(1)
    results = {"head_ms_by_rows": head_ms, "forwards": args.forwards, "depth": args.depth, "workloads": {}}
    for name in ("humaneval", "chat", "code-edit"):
        rows = torch.load(work / f"eval-{name}.pt")
        ranks = [unroll(head, row, args.depth, fed="truth")[1] for row in rows]
        first = torch.cat([r[:, 0] for r in ranks])
        top = {b: float((first < b).float().mean()) for b in (1, 2, 3, 4, 8)}
        shapes = {}
        for k in range(1, args.depth + 1):
            chain = {(0,) * d for d in range(1, k + 1)}
            shapes[f"chain {k}"] = (chain, chain)
        for nodes in args.nodes:
            halves = (fit_tree(ranks[0::2], nodes), fit_tree(ranks[1::2], nodes))
            shapes[f"tree {nodes}"] = halves
        measured = {}
        for label, (fit_even, fit_odd) in shapes.items():
            forwards = tokens = 0
            cost = 0.0
            for index, answer in enumerate(ranks):
                tree = fit_odd if index % 2 == 0 else fit_even  # counted on prompts it was not fitted on
                f, n = tree_steps(answer, tree)
                forwards, tokens = forwards + f, tokens + n
                cost += f * tree_ms(tree, head_ms, target_ms)
            per_forward = tokens / forwards
            measured[label] = {"tokens_per_forward": per_forward, "x_plain": tokens * plain / cost,
                               "tree": sorted(fit_even, key=lambda node: (len(node), node))}
            log(f"{name} {label}: {per_forward:.2f} tokens/forward, {tokens * plain / cost:.2f}x plain")
        results["workloads"][name] = {"first_guess_in_top": top, "shapes": measured}
    from verispec.bench.machine import machine_description

    results["machine"] = machine_description()
    results["command"] = " ".join(sys.argv)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


def cmd_export(args) -> None:
    from verispec.bench.machine import machine_line
    from verispec.models.loading import load_model

    head, saved = trained_head(Path(args.work), load_model(TARGET), strict=True)
    about = {key: value for key, value in saved.items() if key not in ("state", "vocab")}
    about["data"] = sorted(path.stem for path in Path(args.work).glob("train-*.pt"))  # what train read
    about["machine"] = machine_line()
    write_head(head, about, args)


def write_head(head: DraftHead, about: dict, args) -> None:
    """Save a trained head as a head file in args.weights: with args.ship the one verispec ships for the target (in
    place of the one shipped before), else at args.out or where `make head` puts it. With args.vocab_rows N, over
    the N ids the target chose most in args.work's rows instead of the vocabulary it trained over (see vocab)."""
    out = SHIPPED_HEADS / f"{TARGET}.safetensors" if args.ship else Path(args.out or built_head_path(TARGET))
    save_head(head, out, TARGET, about, args.weights)
    about = {**about, "weights": args.weights}
    if getattr(args, "vocab_rows", 0):
        ranking, note = training_ranking(Path(args.work), len(head.embed))
        about = with_vocab(out, ranking[: args.vocab_rows].sort().values, out, {**note, "from": "its training's"})
    if args.ship:
        ship_head(out, TARGET, about)
    log(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    collect = commands.add_parser("collect")
    collect.add_argument("--text-tokens", type=int, default=100_000)
    collect.add_argument("--text-seed", type=int, default=0,
                         help="another seed draws other files: more text beside what is collected (train-text-SEED)")
    collect.add_argument("--early-layers", type=int, nargs="*", default=[4, 8, 14, 21])
    collect.add_argument("--more", action="store_true",
                         help="also HumanEval and code-edit 80.., more chat, and all training prompts answered sampled")
    collect.add_argument("--self-chat", type=int, default=0, metavar="N",
                         help="also N questions the target writes itself (SELF_CHAT_TOPICS), answered greedily")
    collect.add_argument("--self-chat-more", type=int, default=0, metavar="N",
                         help="also N questions the target writes itself about SELF_CHAT_MORE_TOPICS, answered "
                              "greedily (none of --self-chat's)")
    collect.add_argument("--stdlib-code", type=int, default=0, metavar="N",
                         help="N standard-library functions to complete and N to edit, answered greedily")
    collect.add_argument("--stdlib-skip", type=int, default=0, metavar="M",
                         help="with --stdlib-code: after the first M of each (a further batch: train-stdlib-*-fromM)")
    collect.add_argument("--sampled-again", nargs="+", default=[], metavar="SET",
                         help="also each kept SET's prompts answered once more, sampled (temperature 0.7): SET-sampled")
    collect.add_argument("--store", default=str(answer_store.STORE),
                         help="where answer sets are kept as token ids: a kept set is only teacher-forced ('': none)")
    collect.add_argument("--stored", action="store_true", help="teacher-force every kept set in --store as well")
    keep = commands.add_parser("keep", help="the answer sets collected in --work, kept in --store as token ids")
    keep.add_argument("--store", default=str(answer_store.STORE))
    train = commands.add_parser("train")
    train.add_argument("--minutes", type=float, default=20)
    train.add_argument("--vocab", type=int, default=32768)
    train.add_argument("--intermediate", type=int, default=4096)
    train.add_argument("--batch", type=int, default=8)
    train.add_argument("--lr", type=float, default=5e-4)
    train.add_argument("--ce-weight", type=float, default=0.1)
    train.add_argument("--init", action="store_true", help="go on training the head in --work (head.pt)")
    train.add_argument("--init-file", default=None, metavar="HEAD_FILE",
                       help="go on training a head file (such as the shipped one) instead: its vocabulary and width")
    evaluate = commands.add_parser("evaluate")
    evaluate.add_argument("--out", required=True)
    evaluate.add_argument("--depth", type=int, default=6)
    evaluate.add_argument("--draft-model", action=argparse.BooleanOptionalAction, default=True,
                          help="also measure the default draft model's first-position agreement")
    export = commands.add_parser("export", help="the trained head as a head file the engine loads (--draft FILE)")
    export.add_argument("--out", default=None, help="a .safetensors path; default where `make head` puts it")
    export.add_argument("--ship", action="store_true",
                        help="as the head verispec ships (verispec/data/heads, sha256 in heads.json), replacing it")
    export.add_argument("--vocab-rows", type=int, default=0, metavar="N",
                        help="over the N ids the target chose most in --work's rows (see vocab), not its training's")
    for command in (evaluate, export):
        command.add_argument("--weights", choices=HEAD_WEIGHTS, default="float32",
                             help="the head file's storage (int8: per-row int8 matrices, a quarter of the bytes); "
                                  "evaluate measures the head as that storage holds it")
    price = commands.add_parser("price")
    price.add_argument("runs", nargs="+", help="results.json of evaluate runs")
    price.add_argument("--forwards", default="benchmarks/results/xeon/tree-potential/run.json")
    vocab = commands.add_parser("vocab", help="the head file over output vocabularies of other sizes, priced")
    vocab.add_argument("--head", default=str(SHIPPED_HEADS / f"{TARGET}.safetensors"), help="a last-layer head file")
    vocab.add_argument("--sizes", type=int, nargs="+", default=[8192, 12288, 16384, 24576, 32768, 49152, 65536])
    vocab.add_argument("--depth", type=int, default=4, help="chains of 1..depth; acceptance at step starts at depth")
    vocab.add_argument("--out", default=None, help="results.json; with --write: the head file (default: make head's)")
    vocab.add_argument("--write", type=int, default=0, metavar="SIZE",
                       help="write the head file over the SIZE most chosen ids instead of measuring")
    vocab.add_argument("--ship", action="store_true", help="with --write: as the head verispec ships, replacing it")
    trees = commands.add_parser("trees", help="token trees over the head's guesses, priced (issue 31 item 3)")
    trees.add_argument("--out", required=True)
    trees.add_argument("--depth", type=int, default=6)
    trees.add_argument("--nodes", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 9, 11, 15])
    trees.add_argument("--forwards", default="benchmarks/results/xeon/tree-potential/run.json")
    for command in (collect, keep, train, evaluate, export, trees, vocab):
        command.add_argument("--work", required=True)
        command.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    commands = {"collect": cmd_collect, "train": cmd_train, "evaluate": cmd_evaluate, "price": cmd_price,
                "export": cmd_export, "trees": cmd_trees, "vocab": cmd_vocab, "keep": cmd_keep}
    commands[args.command](args)


if __name__ == "__main__":
    main()
