"""With --workers N each front parses with the config's parser (``parser:`` section)."""

from __future__ import annotations

import pytest

from epp.parsing.parser import Parser
from epp.server.workers import _front_parser, front_argv


def test_front_argv_carries_the_parser_type() -> None:
    def argv(parser_type: str | None) -> list[str]:
        return front_argv(core_socket="/tmp/s", grpc_port=1, bind_address="127.0.0.1",
                          max_body=10, secure_serving=False, cert_path=None,
                          log_level="info", parser_type=parser_type)

    with_parser = argv("passthrough-parser")
    assert with_parser[with_parser.index("--parser") + 1] == "passthrough-parser"
    assert "--parser" not in argv(None)


def test_front_builds_the_named_parser() -> None:
    parser = _front_parser("vllmgrpc-parser")
    assert isinstance(parser, Parser) and parser.type_name == "vllmgrpc-parser"
    assert _front_parser(None) is None
    with pytest.raises(SystemExit, match="not a parser plugin"):
        _front_parser("queue-scorer")
