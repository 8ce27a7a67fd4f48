-- OURS: PostgreSQL 18's virtual generated columns (never replicated, computed on read on each side)
CREATE TABLE gen_virtual (id int PRIMARY KEY, a int, twice int GENERATED ALWAYS AS (a * 2) VIRTUAL, body text, body_len int GENERATED ALWAYS AS (length(body)));
INSERT INTO gen_virtual (id, a, body) VALUES (1, 1, 'x'), (2, NULL, repeat('v', 9000));
