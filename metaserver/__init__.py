"""kvfs.metaserver: block metadata, placement and membership (lands with the metaserver issue)."""
