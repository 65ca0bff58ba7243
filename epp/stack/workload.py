"""A realistic chat workload: shared system prompts and multi-turn conversations.

Each conversation picks one of a few long system prompts (shared by many users, as
production traffic shares them), then runs several turns; every turn resends the whole
history (system prompt, earlier questions and the answers received) plus a new question,
so consecutive turns of a conversation share a growing prefix. Deterministic for a seed.
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

    system_prompts: int = 4
    system_prompt_words: int = 400
    turns_per_conversation: int = 4
    question_words: int = 40
    max_tokens: int = 32
    seed: int = 1


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
            + " ".join(_sentence(self._rng, 12) for _ in range(spec.system_prompt_words // 13))
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
