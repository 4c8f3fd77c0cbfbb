"""The CLI's stdlib token pieces (areal_cli.inf.trace_pieces, for `areal inf trace`) are the
data proxy's: for every id of each model's tokenizer, the same bytes as
`areal_proxy.common.tokenizer.ModelTokenizer.token_bytes`, which reads the vocabulary with the
`tokenizers` library."""

from __future__ import annotations

from pathlib import Path

import pytest
from testpaths import PARROT, RANDOM

from areal_cli.inf.trace_pieces import Pieces
from areal_proxy.common.tokenizer import ModelTokenizer


def _folders():
    from areal_cli.errors import CLIError
    from areal_cli.models import resolve_short_name

    out = [PARROT, RANDOM]
    try:
        smol = resolve_short_name("smollm2")
    except CLIError:
        smol = None
    return [*out, Path(smol)] if smol else out


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: p.name)
def test_every_id_decodes_as_the_proxy_does(folder):
    mine = Pieces.from_dir(folder)
    proxy = ModelTokenizer.from_dir(folder)
    ids = range(proxy.vocab_size)
    differ = [i for i in ids if mine.token_bytes(i) != proxy.token_bytes(i)]
    assert not differ, f"{len(differ)} ids differ, e.g. {differ[:5]}"
    assert len(mine.vocab) == proxy.vocab_size
