"""The database: its engine and sessions, the tables, the migrations runner, and the paths a
request takes to it (admission to a session, writes from the event loop)."""
