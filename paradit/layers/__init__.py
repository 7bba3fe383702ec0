"""Building blocks shared by the model families: plain single-device math."""
