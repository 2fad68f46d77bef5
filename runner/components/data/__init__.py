"""The data a run trains on, each kind of record to token rows: text cut into blocks
(prepare, stream), instruction examples (instruct), preference pairs (preference,
preference_batch), prompts for online RL (prompts), mixtures of sources (mixture), the
launcher's checks on data files (checks), the label convention (labels), and each
epoch's batches for every rank (epoch_batches)."""
