"""Model families: the conversions that make a merge write what `save_pretrained` of the same model
writes (the Hub layout serving engines load), as plan transforms: names and extents, never bytes."""
