"""A realistic chat workload: shared system prompts and multi-turn conversations.

Each conversation picks one of a few long system prompts (shared by many users, as
production traffic shares them), then runs several turns; every turn resends the whole
history (system prompt, earlier questions and the answers received) plus a new question,
so consecutive turns of a conversation share a growing prefix. Deterministic for a seed.

The default shape is where prefix reuse matters, as in production chat: by the last turn
the conversation's own history is longer than its system prompt, so a pod that has the
conversation cached computes a turn's new tokens only, and any other pod recomputes the
whole history (docs/local-stack.md, "Reading the demo's summary").
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_TOPICS = ("billing", "latency", "storage", "networking", "security", "pricing", "quotas",
           "backups", "upgrades", "monitoring", "scaling", "migrations")
_VERBS = ("explain", "compare", "summarise", "debug", "estimate", "plan", "review", "list")
_WORDS = ("cluster", "replica", "token", "cache", "request", "queue", "budget", "region",
          "policy", "tenant", "model", "adapter", "prompt", "batch", "gateway", "endpoint",
          "latency", "throughput", "window", "context", "shard", "node", "rack", "zone")


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n)) + "."


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Shape of the workload. Lengths are in words (the simulator counts words as tokens)."""

    system_prompts: int = 6
    system_prompt_words: int = 1000
    turns_per_conversation: int = 8
    question_words: int = 150
    max_tokens: int = 300
    seed: int = 1

    @property
    def question_tokens(self) -> int:
        """Tokens (words) of one question: "Please <verb> <topic>:" and the sentence."""
        return 3 + self.question_words

    @property
    def fresh_tokens_per_turn(self) -> int:
        """What a turn adds to its conversation's cached prefix on the pod that served the
        previous turn: the previous answer (the simulator caches prompt blocks, never
        generated tokens) and the new question."""
        return self.max_tokens + self.question_tokens

    @property
    def last_turn_words(self) -> int:
        """Prompt length (words) of a conversation's last turn."""
        t = self.turns_per_conversation
        return (self.system_prompt_words + t * self.question_tokens
                + (t - 1) * self.max_tokens)


@dataclass(slots=True)
class Conversation:
    """One user's chat: a system prompt and the messages so far."""

    system_index: int
    messages: list[dict[str, str]] = field(default_factory=list)
    turns_done: int = 0


class Workload:
    """Generates conversation turns; call :meth:`next_turn` and :meth:`record_answer`."""

    def __init__(self, spec: WorkloadSpec, model: str) -> None:
        self.spec = spec
        self.model = model
        self._rng = random.Random(spec.seed)
        self.system_prompts = [
            f"System {i}: you are an assistant for the {_TOPICS[i % len(_TOPICS)]} team. "
            + " ".join(_sentence(self._rng, 12)
                       for _ in range(max(0, spec.system_prompt_words - 9 + 11) // 12))
            for i in range(spec.system_prompts)
        ]

    def new_conversation(self) -> Conversation:
        i = self._rng.randrange(len(self.system_prompts))
        return Conversation(i, [{"role": "system", "content": self.system_prompts[i]}])

    def next_turn(self, conv: Conversation) -> dict[str, object]:
        """The request body for the next turn (the question is appended to the history)."""
        q = (f"Please {self._rng.choice(_VERBS)} {self._rng.choice(_TOPICS)}: "
             + _sentence(self._rng, self.spec.question_words))
        conv.messages.append({"role": "user", "content": q})
        return {"model": self.model, "messages": list(conv.messages), "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": self.spec.max_tokens}

    def record_answer(self, conv: Conversation, answer: str) -> bool:
        """Append the answer; True while the conversation has turns left."""
        conv.messages.append({"role": "assistant", "content": answer})
        conv.turns_done += 1
        return conv.turns_done < self.spec.turns_per_conversation
