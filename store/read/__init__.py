"""The SAE-training reader: which rows, in what order, decoded ahead, batched, normalised, handed to trainers."""
