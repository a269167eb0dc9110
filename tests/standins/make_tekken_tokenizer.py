"""Write a Mistral stand-in's ``tekken.json`` from the Tekken vocabulary that the
``mistral_common`` package (a dependency of vLLM) ships as data: the real 131K vocabulary, no
network.

    .venv/bin/python tests/standins/make_tekken_tokenizer.py tests/standins/magistral-small-2507

The ordinary tokens (their bytes, ranks and the pre-tokenizer pattern) are the packaged file's;
the tokenizer version and the special tokens are the stand-in's own, from its
``tekken-special.json``: Mistral's reasoning models use a newer version than the packaged file
(v13), whose special tokens include ``[THINK]`` and ``[/THINK]``, each a control token at a
fixed rank below the 1000 reserved ones. The file is 19 MB, so it is built where it is needed
rather than kept in the repository.
"""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

PACKAGED = "tekken_240911.json"  # the packaged vocabulary: 150K ranks, 131072 used


def build(directory: Path) -> Path:
    wanted = json.loads((directory / "tekken-special.json").read_text())
    packaged = resources.files("mistral_common") / "data" / PACKAGED
    data = json.loads(packaged.read_text())
    data["config"]["version"] = wanted["version"]
    data["special_tokens"] = [
        {"rank": rank, "token_str": token, "is_control": True}
        for rank, token in enumerate(wanted["special_tokens"])
    ]
    data.pop("image", None)  # a text model: no image encoder settings
    path = directory / "tekken.json"
    path.write_text(json.dumps(data))
    return path


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
