"""Building blocks shared by the model families: attention, rotary tables, embeddings, feed-forwards, modulation, the
staged-transformer base. Plain single-device math."""
