"""A component's config dataclass, given whole or built from the keyword call style.

ReaderConfig and StoreSpec stand for what were wide constructors, and the keyword calls trainers,
examples and docs make (`ActivationDataset(store, batch_size=...)`, `create_store(url,
points=...)`) must keep working: the keywords build the dataclass. One rule for both, here.
"""

from __future__ import annotations

import dataclasses


def config_from(cls: type, given, keywords: dict, name: str):
    """`given` (a `cls`, passed as `name=`) or `cls(**keywords)`. Both at once is an error, since
    which one wins would be a guess; so is a keyword that is no field of `cls` (a typo would
    otherwise be a TypeError from deep inside, or silently ignored)."""
    if given is not None:
        if not isinstance(given, cls):
            raise TypeError(f"{name}= must be a {cls.__name__}, got {type(given).__name__}")
        if keywords:
            raise ValueError(f"pass {cls.__name__}'s fields either in {name}= or as keywords, not "
                             f"both (got {name}= and {', '.join(sorted(keywords))}); use "
                             f"dataclasses.replace({name}, ...) to change a few")
        return given
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(keywords) - set(names))
    if unknown:
        raise TypeError(f"unknown {cls.__name__} field(s) {', '.join(unknown)}; its fields are "
                        f"{', '.join(names)}")
    return cls(**keywords)


__all__ = ["config_from"]
