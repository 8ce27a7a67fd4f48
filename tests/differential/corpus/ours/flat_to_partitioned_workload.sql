-- OURS: workload for flat_to_partitioned_*.sql
INSERT INTO measurements SELECT g, 'eu', g FROM generate_series(301, 2500) g;

UPDATE measurements SET id = id + 5000 WHERE id % 50 = 0;

UPDATE measurements SET v = 'NaN' WHERE id BETWEEN 10 AND 20;

DELETE FROM measurements WHERE id % 13 = 0;
