-- OURS: workload for generated_virtual.sql
INSERT INTO gen_virtual (id, a, body) SELECT g, g, repeat('w', g) FROM generate_series(10, 1500) g;

UPDATE gen_virtual SET a = a * 3 WHERE id % 4 = 0;

DELETE FROM gen_virtual WHERE id % 11 = 0;
