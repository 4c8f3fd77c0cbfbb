"""What the data proxy records: sessions, interactions, rewards, and their export.

Storage is SQLite in WAL mode, one database per proxy; an interaction or a
reward is committed before it is acknowledged, so it survives a SIGKILL.
Only live sessions are held in memory, so memory stays bounded however many
sessions pass through.
"""
