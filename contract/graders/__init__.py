"""Graders as OpenAI defines them (`string_check`, `text_similarity`, `python`,
`score_model`, `multi`): their request shapes, the templates they read a sample and a
dataset item through, and how each turns one sample into a reward. Shared by the service
(`/v1/fine_tuning/alpha/graders/run|validate`, checks before a run is stored) and the
worker (rewards during training). Torch-free."""
