-- OURS: stored generated columns beside a key, in the key's table and referring to a toasted column
CREATE TABLE gen_stored (id int PRIMARY KEY, price numeric, qty int, total numeric GENERATED ALWAYS AS (price * qty) STORED, body text, body_len int GENERATED ALWAYS AS (length(body)) STORED);
INSERT INTO gen_stored (id, price, qty, body) VALUES (1, 'NaN', 2, 'x'), (2, 'Infinity', 3, repeat('b', 10000)), (3, 2.5, 4, NULL);
