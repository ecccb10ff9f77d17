"""kvfs.engine: the MLA inference engine on kvfs (lands with the engine issue)."""
