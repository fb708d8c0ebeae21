"""Tasks with verifiable rewards: their items, prompts, rewards and data files, and the text codec. Pure of
torch and of the store."""
