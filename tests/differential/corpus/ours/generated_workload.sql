-- OURS: workload for generated.sql (and generated_virtual.sql on PostgreSQL 18)
INSERT INTO gen_stored (id, price, qty, body) SELECT g, g / 3.0, g % 7, repeat('z', g * 10) FROM generate_series(10, 1200) g;

UPDATE gen_stored SET qty = qty + 1 WHERE id % 2 = 0;

UPDATE gen_stored SET price = '-Infinity' WHERE id = 3;

DELETE FROM gen_stored WHERE id % 9 = 0;
