"""Offline batch inference (`moe-export batch`): OpenAI batch JSONL or a folder of documents, through the
runtime's continuous batching, on one machine or on Ray Data."""
